"""The operator's commands for Redis itself: ``functions load`` (the Function library that
receivers' dead letters need) and ``streams repair`` (a stream whose ids ran ahead of the
server's clock, see ``broker_adapter.redis.repair``).

Both run with the Redis user of ``--redis``: ``functions load`` needs ``+function|load``,
``streams repair`` the operator's own user (it renames the stream and creates groups: see
docs/OPERATIONS.md "A stream with ids in the future"). Each is logged with the operating
system user who ran it (``app.audit``).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from typing import Any

from broker_adapter.app.audit import audit
from broker_adapter.errors import ConfigError

log = logging.getLogger("broker_adapter.app.audit")


def add_commands(
    sub: Any, add_redis: Callable[[Any], None], add_prefix: Callable[[Any], None]
) -> None:
    """Add ``functions`` and ``streams`` to the CLI's subcommands."""
    fn = sub.add_parser("functions", help="the Redis Function library broker_adapter calls")
    fns = fn.add_subparsers(dest="fn_command", required=True)
    load = fns.add_parser(
        "load",
        help="load (or replace) it on the server, every master of a cluster (needs +function|load)",
    )
    add_redis(load)

    st = sub.add_parser("streams", help="repair a stream")
    sts = st.add_subparsers(dest="streams_command", required=True)
    what = "move the live entries of a stream whose ids ran ahead of the server clock to a"
    rep = sts.add_parser("repair", help=f"{what} fresh stream (the adapter may run)")
    add_redis(rep)
    add_prefix(rep)
    rep.add_argument(
        "--stream", required=True, metavar="KEY", help="the stream's key, e.g. ba:{in.alice}:tasks"
    )
    rep.add_argument(
        "--max-entries",
        type=int,
        default=None,
        metavar="N",
        help="refuse a stream with more live entries [default: 10000]",
    )


def cmd_functions(args: argparse.Namespace) -> int:
    from broker_adapter.redis.client import connect
    from broker_adapter.redis.functions import LIBRARY_NAME, load_functions

    audit("functions load")
    client = connect(args.redis)
    try:
        load_functions(client)
    finally:
        client.close()
    print(json.dumps({"library": LIBRARY_NAME, "loaded": True}, sort_keys=True))
    return 0


def cmd_streams(args: argparse.Namespace) -> int:
    from broker_adapter.redis.client import connect, translated
    from broker_adapter.redis.repair import DEFAULT_MAX_ENTRIES, MAX_ENTRIES_LIMIT, repair_stream

    stream: str = args.stream
    if not stream.startswith(f"{args.prefix}:{{"):
        raise ConfigError(f"--stream {stream!r} is not a stream of prefix {args.prefix!r}")
    if ":poisoned:" in stream:
        raise ConfigError(f"--stream {stream!r} is a kept poisoned stream, not a live one")
    max_entries = DEFAULT_MAX_ENTRIES if args.max_entries is None else args.max_entries
    if not 1 <= max_entries <= MAX_ENTRIES_LIMIT:
        raise ConfigError(f"--max-entries must be 1..{MAX_ENTRIES_LIMIT}")
    audit("streams repair", stream=stream, max_entries=max_entries)
    client = connect(args.redis)
    try:
        with translated():
            seconds, micros = client.time()
        result = repair_stream(
            client, stream, server_ms=seconds * 1000 + micros // 1000, max_entries=max_entries
        )
    finally:
        client.close()
    log.info("audit: streams repair of %s done: %d entries moved", stream, result.moved)
    out = {
        "stream": stream,
        "moved": result.moved,
        "kept_as": result.kept_as,
        "groups": result.groups,
    }
    print(json.dumps(out, sort_keys=True))
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "functions": cmd_functions,
    "streams": cmd_streams,
}
