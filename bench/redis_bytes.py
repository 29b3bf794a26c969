"""What Redis keeps per message after a run, before and after the trims.

Not a test. Starts a private redis-server, runs the adapter (``Adapter``, the code of
``broker-adapter run``, with ``--retention`` given as ``AdapterConfig.retention_s``) and the
benchmark receiver (``bench/run.py _receive``) as subprocesses, publishes ``--n`` signed
messages, waits until every reply is applied, samples Redis (``INFO memory`` used_memory,
``DBSIZE``, ``MEMORY USAGE`` of the streams, the publication records), then waits until the
trims have run past the retention window (both processes still running) and samples again.
Prints one JSON object: bytes per message above the empty server, before and after. Usage::

    .venv/bin/python bench/redis_bytes.py --n 10000 --retention 5
"""

from __future__ import annotations

import argparse
import json
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import PRINCIPAL, ROOT

from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import connect, text

RUN_PY = Path(__file__).resolve().parent / "run.py"


def child_run(args: argparse.Namespace) -> int:
    """``broker-adapter run`` with a retention window (``Adapter``), until SIGTERM."""
    from broker_adapter.app.adapter import Adapter
    from broker_adapter.app.adapter_config import AdapterConfig

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    config = AdapterConfig(
        redis_url=args.redis, db_path=Path(args.db), handler="broker_adapter.examples:echo",
        keyring_path=Path(args.keyring), prefix=args.prefix, name="bytes",
        retention_s=args.retention,
    )  # fmt: skip
    return Adapter(config).run(stop)


def sample(client: Any, prefix: str) -> dict[str, Any]:
    keys = Keys(prefix)
    streams = {
        "inbound": keys.inbound(),
        "inbound_dead": keys.inbound_dead(),
        "replies": keys.replies(PRINCIPAL),
        "replies_dead": keys.replies_dead(PRINCIPAL),
    }
    records = sum(1 for _ in client.scan_iter(match=f"{prefix}:*:rid:*", count=1000))
    return {
        "used_memory": int(client.info("memory")["used_memory"]),
        "dbsize": int(client.dbsize()),
        "records": records,
        "xlen": {name: int(client.xlen(key)) for name, key in streams.items()},
        "memory_usage": {name: int(client.memory_usage(key) or 0) for name, key in streams.items()},
    }


def effects(rx_db: Path) -> int:
    if not rx_db.exists():
        return 0
    conn = sqlite3.connect(rx_db, timeout=10)
    try:
        return int(conn.execute("SELECT count(*) FROM bench_effects").fetchone()[0])
    except sqlite3.OperationalError:
        return 0
    finally:
        conn.close()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="ba-bytes-"))
    server = common.start_server(workdir)
    keyring = common.write_keyring(workdir / "keys.json")
    prefix = common.new_prefix()
    client = connect(server.url)
    env = common.python_env()
    log = (workdir / "run.log").open("w")
    procs: list[subprocess.Popen[str]] = []
    try:
        empty = sample(client, prefix)
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "_run", "--redis", server.url, "--db",
             str(workdir / "a.db"), "--keyring", str(keyring), "--prefix", prefix,
             "--retention", str(args.retention)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, text=True,
        ))  # fmt: skip
        rx_db = workdir / "rx.db"
        rx = subprocess.Popen(
            [sys.executable, str(RUN_PY), "_receive", "--redis", server.url, "--db",
             str(rx_db), "--prefix", prefix],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=log, env=env, text=True,
        )  # fmt: skip
        procs.append(rx)
        assert rx.stdout is not None
        if rx.stdout.readline().strip() != "ready":
            raise RuntimeError(f"receiver did not start; see {workdir / 'run.log'}")
        subprocess.run(
            [sys.executable, str(RUN_PY), "_publish", "--redis", server.url, "--prefix",
             prefix, "--count", str(args.n), "--tag", "m",
             "--deadline-in", str(min(3600.0, args.retention))],
            cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        deadline = time.monotonic() + 600
        while effects(rx_db) < args.n:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"only {effects(rx_db)}/{args.n} applied; see run.log")
            time.sleep(0.1)  # polling the receiver's file, with a deadline
        done_at = time.monotonic()
        before = sample(client, prefix)
        # the window, then the trims' interval (10 s) and a margin
        deadline = done_at + args.retention + 10 + args.margin
        after = before
        while time.monotonic() < deadline:
            time.sleep(1.0)  # a run on the real clock: waiting for the window is the point
            after = sample(client, prefix)
            if after["records"] == 0 and all(n <= 1 for n in after["xlen"].values()):
                break
        n = args.n

        def per(s: dict[str, Any]) -> float:
            return round((s["used_memory"] - empty["used_memory"]) / n, 1)

        return {
            "n": n, "retention_s": args.retention, "redis": text(client.info()["redis_version"]),
            "bytes_per_message_before_trim": per(before),
            "bytes_per_message_after_trim": per(after),
            "empty": empty, "before_trim": before, "after_trim": after,
        }  # fmt: skip
    finally:
        common.shut_down(procs, log, client, server=server)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd")
    r = sub.add_parser("_run")
    for name in ("--redis", "--db", "--keyring", "--prefix"):
        r.add_argument(name, required=True)
    r.add_argument("--retention", type=float, required=True)
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--retention", type=float, default=5.0)
    parser.add_argument("--margin", type=float, default=20.0, help="extra seconds to wait")
    args = parser.parse_args(argv)
    if args.cmd == "_run":
        return child_run(args)
    print(json.dumps(measure(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
