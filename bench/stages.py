"""Latency publish -> receiver effect, split by stage, at a fixed offered load.

Not a test. Runs the same pipeline as ``bench/run.py`` (``broker-adapter run`` with 2
workers, a receiver, an agent publishing on a schedule) once, then reads the stage
timestamps the run left behind and prints their percentiles:

* **ingest**: publish (time carried in the payload) -> the accept transaction began;
* **work**: accept began -> the worker's settle began (wake-up, claim, handler, batch);
* **publish**: settle began -> Redis confirmed the reply (settle commit, the XADD script);
* **receive**: reply confirmed -> the receiver's receipt (XREADGROUP, receipt transaction);
* **effect**: receipt -> the effect's own timestamp, inside the same transaction;
* **total**: publish -> effect.

With several ``--rate`` values (``--rate 250 --rate 500 ...``) each rate is a run of its own,
on a fresh pipeline, and a last table puts their totals side by side: where the latency
bends is where the write lock of the main SQLite file starts to queue.

Usage::

    .venv/bin/python bench/stages.py [--rate 1000 ...] [--seconds 5] [--appendfsync always]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import run as bench_run

STAGES = ("ingest", "work", "publish", "receive", "effect", "total")


def stage_times(db: Path, rx_db: Path, tag: str) -> dict[str, list[float]]:
    """Seconds spent in each stage, per message of the run tagged ``tag``."""
    main = sqlite3.connect(db)
    rx = sqlite3.connect(rx_db)
    try:
        rows = main.execute(
            "SELECT t.payload, t.created_at, t.finished_at, o.sent_at, o.reply_id"
            " FROM tasks t JOIN outbox o ON o.task_id = t.task_id WHERE t.message_id LIKE ?",
            (f"{tag}-%",),
        ).fetchall()
        effects = {
            reply_id: (received, effect)
            for reply_id, received, effect in rx.execute(
                "SELECT b.reply_id, r.received_at, b.effect_at FROM bench_effects b"
                " JOIN receipts r ON r.reply_id = b.reply_id"
            )
        }
    finally:
        main.close()
        rx.close()
    out: dict[str, list[float]] = {name: [] for name in STAGES}
    for payload, created, finished, sent, reply_id in rows:
        published = json.loads(payload)["t"]
        received, effect = effects[reply_id]
        for name, value in zip(
            STAGES,
            (created - published, finished - created, sent - finished, received - sent,
             effect - received, effect - published),
            strict=True,
        ):  # fmt: skip
            out[name].append(value)
    return out


def measure(rate: float, seconds: float, workers: int, appendfsync: str) -> dict[str, list[float]]:
    """One run at ``rate`` msg/s offered for ``seconds``: each stage's times, in ms, sorted."""
    n = int(rate * seconds)
    with tempfile.TemporaryDirectory(prefix="ba-stages-") as tmp:
        workdir = Path(tmp)
        keyring = common.write_keyring(workdir / "keyring.json")
        server = common.start_server(workdir, appendfsync)
        try:
            pipe = bench_run.Pipeline(server.url, workdir, keyring, workers)
            try:
                pipe.warm_up()
                pipe.publish(n, "l", rate=rate).communicate(timeout=seconds * 3 + 60)
                pipe.wait_effects("l", n, timeout_s=120)
            finally:
                pipe.close()
            times = stage_times(pipe.db, pipe.rx_db, "l")
        finally:
            server.stop()
    return {name: sorted(v * 1000 for v in values) for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rate", type=float, action="append", help="offered msg/s (repeatable) [1000]"
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--appendfsync", default=common.DEFAULT_APPENDFSYNC, choices=["always", "everysec", "no"]
    )
    args = parser.parse_args()
    totals: list[tuple[float, list[float]]] = []
    for rate in args.rate or [1000.0]:
        times = measure(rate, args.seconds, args.workers, args.appendfsync)
        print(
            f"{int(rate * args.seconds):,} messages at {rate:,.0f} msg/s offered,"
            f" appendfsync={args.appendfsync}"
        )
        for name in STAGES:
            values = times[name]
            print(
                f"  {name:8s} p50 {common.percentile(values, 50):7.2f} ms"
                f"  p99 {common.percentile(values, 99):7.2f} ms  max {values[-1]:7.2f} ms"
            )
        totals.append((rate, times["total"]))
    if len(totals) > 1:
        print("publish -> effect by offered load:")
        for rate, values in totals:
            print(
                f"  {rate:7,.0f} msg/s  p50 {common.percentile(values, 50):7.2f} ms"
                f"  p99 {common.percentile(values, 99):7.2f} ms  max {values[-1]:7.2f} ms"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
