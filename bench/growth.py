"""Bounded growth: two rounds of messages through a short retention window, then what stayed.

Not a test: a measurement. Starts a private redis-server, ``broker-adapter run`` and
``broker-adapter receive`` (both ``--retention S``, the real CLI, one keyring file 0600),
and runs two rounds after 200 warm-up messages. A round publishes ``--n`` signed envelopes
pipelined (deadlines ``--ahead`` seconds away, inside the window: a request is purged only
once its deadline has passed), waits until every reply is applied (the receiver's group on
the reply stream has read all the round's replies and has none pending: it acknowledges
only after the receipt's commit), then polls until the window, the trim interval
(``trim_every_s``, 10 s) and the purge interval have passed and the figures settle, giving
up after a bound, and samples Redis (``bench/redis_bytes.sample``) and both SQLite files.
Both processes keep running throughout. Prints one JSON object, with PASS/FAIL for the
three criteria of "done" (issue 17): Redis under 64 bytes per message of both rounds, under
1% of the rows left in every table, neither SQLite file (main + ``-wal``) growing in round 2
by more than 15% of its size after round 1. Exits 0 either way. Usage::

    .venv/bin/python bench/growth.py
    .venv/bin/python bench/growth.py --n 10000 --retention 5 --margin 30
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import redis_bytes
from common import KEYRING, PRINCIPAL

from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import RECEIVER_GROUP, Keys
from broker_adapter.redis.client import connect, text
from broker_adapter.redis.trimming import DEFAULT_TRIM_EVERY_S
from broker_adapter.store.retention import PURGE_EVERY_S

PUBLISH_BATCH = 200
#: Messages through both processes before round 1 (purged within round 1's window).
WARMUP = 200
TABLES = {"adapter": ("tasks", "inbox", "outbox"), "receiver": ("receipts",)}
#: The criteria of issue 17's "done when".
MAX_REDIS_BYTES_PER_MESSAGE = 64.0
MAX_ROWS_FRACTION = 0.01
MAX_SQLITE_GROWTH = 0.15


def publish(client: Any, prefix: str, n: int, tag: str, ahead_s: float) -> None:
    """``n`` signed envelopes, pipelined ``PUBLISH_BATCH`` XADDs at a time."""
    stream = Keys(prefix).inbound()
    for lo in range(0, n, PUBLISH_BATCH):
        now = time.time()
        pipe = client.pipeline(transaction=False)
        for i in range(lo, min(n, lo + PUBLISH_BATCH)):
            payload = dict(common.PAYLOAD_BASE, doc=f"doc-{i}", i=i, t=now)
            env = Envelope.build(message_id=f"{tag}-{i}", sender=PRINCIPAL, payload=payload,
                                 deadline=now + ahead_s)  # fmt: skip
            pipe.xadd(stream, KEYRING.sign(env))
        pipe.execute()


def replies_applied(client: Any, prefix: str) -> int | None:
    """Replies the receiver has read and acknowledged, over the stream's life; None while
    its group has entries pending or unread (or does not exist yet)."""
    stream = Keys(prefix).replies(PRINCIPAL)
    if not client.exists(stream):
        return None
    info = client.xinfo_stream(stream)
    for group in client.xinfo_groups(stream):
        if text(group["name"]) != RECEIVER_GROUP:
            continue
        if int(group["pending"]) or text(group["last-delivered-id"]) != text(
            info["last-generated-id"]
        ):
            return None
        return int(info["entries-added"])
    return None


def wait_applied(client: Any, prefix: str, total: int, procs: list[Any], timeout_s: float) -> float:
    """Poll until ``total`` replies are applied; returns the seconds it took."""
    start = time.monotonic()
    while (replies_applied(client, prefix) or 0) < total:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process stopped early; see run.log / receive.log")
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"not every reply applied after {timeout_s:.0f} s")
        time.sleep(0.2)  # polling the receiver's group, with a deadline
    return time.monotonic() - start


def task_states(db: Path) -> dict[str, int]:
    """Tasks per state (those not purged yet): how many ran and how many expired unrun."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        rows = conn.execute("SELECT state, count(*) FROM tasks GROUP BY state").fetchall()
    finally:
        conn.close()
    return {str(state): int(n) for state, n in rows}


def sample(client: Any, prefix: str, db: Path, rx_db: Path) -> dict[str, Any]:
    """Redis (``redis_bytes.sample``), rows per table and file sizes of both databases."""
    rows = {**common.db_facts(db, TABLES["adapter"]), **common.db_facts(rx_db, TABLES["receiver"])}
    rows.pop("free_pages")
    files = {}
    for name, path in (("adapter", db), ("receiver", rx_db)):
        main, wal = common.file_size(path), common.file_size(Path(f"{path}-wal"))
        files[name] = {"db": main, "wal": wal, "total": main + wal}
    return {"redis": redis_bytes.sample(client, prefix), "rows": rows, "sqlite": files}


def settled(s: dict[str, Any]) -> bool:
    """Everything a window ago is gone: no rows, no publication records, streams trimmed."""
    r = s["redis"]
    return (
        sum(s["rows"].values()) == 0
        and r["records"] == 0
        and all(n <= 1 for n in r["xlen"].values())
    )


def wait_window(client: Any, prefix: str, db: Path, rx_db: Path, args: argparse.Namespace,
                procs: list[Any]) -> tuple[dict[str, Any], float]:  # fmt: skip
    """Poll, once a second, until the window, a trim and a purge interval have passed and
    the figures settled, or ``margin`` seconds more; returns the last sample and the wait."""
    start = time.monotonic()
    least = args.retention + max(args.ahead, 0.0)
    bound = least + DEFAULT_TRIM_EVERY_S + PURGE_EVERY_S + args.margin
    while True:
        time.sleep(1.0)  # a run on the real clock: waiting for the window is the point
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process stopped early; see run.log / receive.log")
        s = sample(client, prefix, db, rx_db)
        waited = time.monotonic() - start
        if (waited >= least and settled(s)) or waited >= bound:
            return s, waited


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    server = common.start_server(workdir)
    keyring = common.write_keyring(workdir / "keyring.json")
    prefix = common.new_prefix()
    db, rx_db = workdir / "adapter.db", workdir / "receiver.db"
    client = connect(server.url)
    run_log = (workdir / "run.log").open("w")
    rx_log = (workdir / "receive.log").open("w")
    procs: list[Any] = []
    try:
        empty = redis_bytes.sample(client, prefix)
        procs.extend(common.start_pipeline(
            server.url, prefix, keyring, db, rx_db, args.retention, run_log, rx_log,
            workers=args.workers, name="growth",
        ))  # fmt: skip
        # both processes up and warm before round 1: deadlines seconds away would otherwise
        # pass while the workers start, and round 1 would be mostly expired tasks
        publish(client, prefix, WARMUP, "warm", args.ahead)
        wait_applied(client, prefix, WARMUP, procs, args.timeout)
        rounds = []
        for r in (1, 2):
            t0 = time.monotonic()
            publish(client, prefix, args.n, f"g{r}", args.ahead)
            published_s = time.monotonic() - t0
            applied_s = wait_applied(client, prefix, WARMUP + r * args.n, procs, args.timeout)
            states = task_states(db)
            s, waited = wait_window(client, prefix, db, rx_db, args, procs)
            rounds.append({"round": r, "publish_s": round(published_s, 1),
                           "applied_s": round(applied_s, 1), "task_states_when_applied": states,
                           "window_wait_s": round(waited, 1),
                           "settled": settled(s), **s})  # fmt: skip
        total = 2 * args.n
        last = rounds[1]
        redis_per = (last["redis"]["used_memory"] - empty["used_memory"]) / total
        keys_per = (last["redis"]["dbsize"] - empty["dbsize"]) / total
        rows_fraction = {t: n / total for t, n in last["rows"].items()}
        growth = {
            name: (last["sqlite"][name]["total"] - first) / first if first else None
            for name in ("adapter", "receiver")
            for first in [rounds[0]["sqlite"][name]["total"]]
        }
        return {
            "n_per_round": args.n, "messages": total, "retention_s": args.retention,
            "deadline_ahead_s": args.ahead, "redis_version": text(client.info()["redis_version"]),
            "redis_empty": {"used_memory": empty["used_memory"], "dbsize": empty["dbsize"]},
            "redis_bytes_per_message": round(redis_per, 2),
            "redis_keys_per_message": round(keys_per, 6),
            "rows_fraction": rows_fraction,
            "sqlite_bytes": {f"round{x['round']}": x["sqlite"] for x in rounds},
            "sqlite_growth_pct": {k: None if g is None else round(100 * g, 2)
                                  for k, g in growth.items()},
            "rounds": rounds,
            "criteria": {
                f"redis_under_{MAX_REDIS_BYTES_PER_MESSAGE:g}_bytes_per_message":
                    verdict(redis_per < MAX_REDIS_BYTES_PER_MESSAGE),
                f"rows_under_{100 * MAX_ROWS_FRACTION:g}pct":
                    verdict(all(f < MAX_ROWS_FRACTION for f in rows_fraction.values())),
                f"sqlite_growth_at_most_{100 * MAX_SQLITE_GROWTH:g}pct":
                    verdict(all(g is not None and g <= MAX_SQLITE_GROWTH
                                for g in growth.values())),
            },
        }  # fmt: skip
    finally:
        common.shut_down(procs, run_log, rx_log, client, server=server)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000, help="messages per round")
    parser.add_argument("--retention", type=float, default=5.0, help="seconds, both processes")
    parser.add_argument("--ahead", type=float, default=4.0, help="deadline, seconds ahead")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--margin", type=float, default=30.0, help="extra seconds to wait")
    parser.add_argument("--timeout", type=float, default=600.0, help="for a round's replies")
    parser.add_argument("--keep", type=Path, default=None, help="copy the logs here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ba-growth-") as tmp:
        try:
            result = measure(args, Path(tmp))
        finally:
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                for name in ("run.log", "receive.log"):
                    if (Path(tmp) / name).exists():
                        (args.keep / name).write_bytes((Path(tmp) / name).read_bytes())
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
