"""The ``broker-adapter`` command line. Parses arguments and calls the library; no logic here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from broker_adapter.errors import BrokerAdapterError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="broker-adapter",
        description="Hand work between agents over Redis Streams without losing or doubling it.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the end-to-end demo on an embedded default")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            from broker_adapter.demo import run_demo

            return run_demo()
    except BrokerAdapterError as exc:
        print(f"broker-adapter: error: {exc}", file=sys.stderr)
        return 2
    return 0
