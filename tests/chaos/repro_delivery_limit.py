"""Reproduction (not a pytest module): transient store errors burn an entry's poison budget.

``python -m tests.chaos.repro_delivery_limit`` exits 1 while the finding stands.

The fault matrix expects a reader whose SQLite is busy (or full) to keep the entry
pending and make full progress once the store is back ("no XACK, backpressure, the PEL holds
the backlog"). But ``GroupReader`` re-reads its own pending entries from ``0`` after EVERY
error, and each such read raises the entry's Redis delivery count; ``_screen`` then
dead-letters entries delivered more than ``max_deliveries`` (10) times. So eleven failed
accept transactions in a row (about two minutes of a held write lock at the default
10 s busy timeout, far less with a shorter one) move a well-formed, authentic request to the
dead-letter stream as ``delivery_limit``: it never becomes a task and never gets a reply,
although nothing was wrong with it. The receiver has the same shape (a busy receipts
database dead-letters good replies, so their effect is never applied).

The script: one signed request, a second connection holding ``BEGIN IMMEDIATE`` on the
adapter database, an ingest whose store has a 50 ms busy timeout, 12 ingest steps, then the
lock is released and one more step runs.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from broker_adapter.client.publisher import Publisher
from broker_adapter.errors import TransientError
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect
from broker_adapter.stages.ingest.config import IngestConfig
from broker_adapter.stages.ingest.ingest import Ingestor
from broker_adapter.store import TaskStore
from broker_adapter.store.db import Database
from tests.support.redis_server import RedisServer


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with RedisServer(root / "redis") as server:
            keyring = Keyring({"alice": {"k1": "alice-secret: a test key of 32 bytes or more"}})
            keys = Keys("repro")
            client = connect(server.url)
            envelope = Envelope.build(
                message_id="m1", sender="alice", payload={"n": 1}, deadline=time.time() + 600
            )
            Publisher(client, keys, "alice", keyring).publish(envelope)

            db_path = root / "adapter.db"
            db = Database(db_path, busy_timeout_ms=50)
            ingest = Ingestor(
                IngestConfig(prefix="repro", consumer="ingest-1"), client, TaskStore(db), keyring
            )
            holder = sqlite3.connect(str(db_path), isolation_level=None)
            holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock
            failures = 0
            for _ in range(12):
                try:
                    ingest.step()
                except TransientError:
                    failures += 1
            holder.execute("COMMIT")  # the store is back
            holder.close()
            ingest.step()

            dead = client.xrange(keys.inbound_dead()) or []
            raw = [(fields or {}).get(b"dl.reason", b"?") for _, fields in dead]
            reasons = [r.decode() if isinstance(r, bytes) else str(r) for r in raw]
            stored = TaskStore(db).find("alice", "m1")
            db.close()
            client.close()
    report = {
        "transient_failures": failures,
        "dead_letter_reasons": reasons,
        "task_stored_after_the_lock_was_released": stored is not None,
    }
    print(json.dumps(report))
    if stored is None and "delivery_limit" in reasons:
        print("FINDING: a good request was dead-lettered (delivery_limit) by transient errors")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
