"""A long-running receiver for one principal, with an append-only effect ledger.

``python -m tests.chaos.receiver --redis URL --db PATH --principal P --consumer C --keyring F``

Runs ``broker_adapter.stages.receiver.Receiver`` with an effect that appends one row to
``chaos_effects`` inside the receipt's own transaction. The ledger has no unique key, so a
reply applied twice would show as two rows: that is what the checker counts (1R). SIGTERM
stops it after the current batch; crash points (``BA_CRASHPOINT=receiver.*``) kill it.
Under ``CHAOS_PLANTED`` it runs with that planted bug (``tests.chaos.planted``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from broker_adapter.backoff import call_until_stopped
from broker_adapter.errors import TransientError
from broker_adapter.protocol.reply import Reply
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect
from broker_adapter.stages.receiver.receiver import Receiver, ReceiverConfig
from broker_adapter.store import ReceiptStore, open_database
from tests.chaos import planted  # noqa: F401 - applies the bug named in CHAOS_PLANTED, if any

LEDGER_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS chaos_effects (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
    " reply_id TEXT NOT NULL, task_id TEXT, status TEXT, fence INTEGER, wall REAL NOT NULL)"
)


def effect(conn: sqlite3.Connection, reply: Reply) -> dict[str, Any]:
    """Append one ledger row in the receipt's transaction."""
    conn.execute(
        "INSERT INTO chaos_effects (reply_id, task_id, status, fence, wall) VALUES (?, ?, ?, ?, ?)",
        (
            reply.reply_id,
            reply.task_id,
            reply.status,
            reply.fence,
            time.time(),
        ),
    )
    return {"status": reply.status}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chaos-receiver")
    parser.add_argument("--redis", required=True)
    parser.add_argument("--db", required=True)
    parser.add_argument("--prefix", default="ba")
    parser.add_argument("--principal", required=True)
    parser.add_argument("--consumer", required=True)
    parser.add_argument("--keyring", required=True, help="keyring file with P's reply keys")
    parser.add_argument("--claim-min-idle-ms", type=int, default=2000)
    parser.add_argument("--take-over-interval-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    db = open_database(args.db)
    db.conn.execute(LEDGER_SCHEMA)
    config = ReceiverConfig(
        prefix=args.prefix,
        principal=args.principal,
        consumer=args.consumer,
        claim_min_idle_ms=args.claim_min_idle_ms,
        take_over_interval_s=args.take_over_interval_s,
    )
    keyring = Keyring.load(args.keyring)
    client = call_until_stopped(stop, lambda: connect(args.redis))  # a cluster: its seed
    if client is None:
        db.close()
        return 0
    receiver = Receiver(config, client, ReceiptStore(db), effect, keyring=keyring)
    try:
        while not stop.is_set():
            try:
                receiver.step()
            except TransientError as exc:
                print(f"chaos-receiver: transient, retrying: {exc}", file=sys.stderr)
                stop.wait(0.2)
    finally:
        db.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
