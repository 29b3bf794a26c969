"""An ingest worker for crash tests, plus the helpers the ingest tests share.

Run as ``python -m tests.support.ingest_script --url ... --prefix ... --db ... --consumer ...
--keyring ...``: it ingests until the inbound stream is drained (every entry delivered to the
group and nothing pending), prints its counters as one JSON line and exits 0; exit 3 means it
did not drain within ``--timeout-s``. With ``BA_CRASHPOINT`` set it SIGKILLs itself at that
point instead, which is the point of it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis

from broker_adapter.clock import FakeClock
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import INGEST_GROUP, Keys
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect, text
from broker_adapter.stages.ingest.config import IngestConfig
from broker_adapter.stages.ingest.ingest import Ingestor
from broker_adapter.store import TaskStore
from broker_adapter.store.backends import open_store
from tests.support.store_script import dump

KEYRING: dict[str, dict[str, str]] = {
    "alice": {
        "alice-2026": "alice secret, first key: 32+ bytes",
        "alice-2025": "alice old key, rotated out: 32+ bytes",
    },
    "bob": {"bob-1": "bob's secret, long enough: 32+ bytes"},
}
#: A day after ``FakeClock``'s start: within the retention window (which bounds deadlines)
#: of a store on the test clock. A store on the real clock needs ``real_deadline()``.
DEADLINE = FakeClock().now() + 24 * 3600


def real_deadline(ahead_s: float = 3600.0) -> float:
    """A deadline ``ahead_s`` from the real clock, for stores that read it."""
    return time.time() + ahead_s


def write_keyring(path: Path) -> Keyring:
    """Write ``KEYRING`` to ``path`` (mode 0600, as ``Keyring.load`` requires) and load it
    back."""
    path.write_text(json.dumps(KEYRING), encoding="utf-8")
    path.chmod(0o600)
    return Keyring.load(path)


def envelope(message_id: str, sender: str = "alice", **over: Any) -> Envelope:
    """A valid task envelope with a far deadline."""
    fields: dict[str, Any] = {
        "message_id": message_id,
        "sender": sender,
        "payload": {"n": message_id, "text": "résumé ✓"},
        "deadline": DEADLINE,
    }
    fields.update(over)
    return Envelope.build(**fields)


def pending_total(client: redis.Redis, stream: str, group: str = INGEST_GROUP) -> int:
    """How many entries the group has delivered but not acknowledged."""
    info = client.xpending(stream, group)
    return int(info["pending"])


def xadd_signed(client: redis.Redis, keys: Keys, keyring: Keyring, envelope: Envelope) -> str:
    """Add ``envelope``, signed, to the shared inbound stream with a plain ``XADD *``, as a
    publisher that writes the stream directly does (a user granted ``+xadd``): the adapter
    reads such entries like the ones it moves from the submit list. The entry id."""
    return text(client.xadd(keys.inbound(), keyring.sign(envelope)))  # type: ignore[arg-type]


def drained(client: redis.Redis, stream: str, group: str = INGEST_GROUP) -> bool:
    """True when the group has been handed every entry of ``stream`` and none is pending,
    and the stream's submit list is empty (every published item moved into the stream)."""
    if client.llen(Keys().submit_for(stream)):
        return False
    if not client.exists(stream):
        return True
    groups = {text(g["name"]): g for g in client.xinfo_groups(stream)}
    g = groups.get(group)
    if g is None:
        return False
    last = text(client.xinfo_stream(stream)["last-generated-id"])
    return text(g["last-delivered-id"]) == last and int(g["pending"]) == 0


def drain(ingestor: Ingestor, client: redis.Redis, timeout_s: float = 15.0) -> int:
    """Step ``ingestor`` until each of its streams is drained; fail after ``timeout_s``.

    Returns:
        how many entries the steps handled.
    """
    handled = 0
    deadline = time.monotonic() + timeout_s
    while not all(drained(client, r.stream) for r in ingestor.readers):
        if time.monotonic() > deadline:
            raise AssertionError(f"ingest did not drain within {timeout_s}s")
        handled += ingestor.step()
    return handled


def age_pending(client: redis.Redis, stream: str, consumer: str, idle_ms: int = 3_600_000) -> int:
    """Make ``consumer``'s pending entries look idle for ``idle_ms`` (XCLAIM ... IDLE JUSTID),
    so a takeover does not have to wait for real time to pass. Returns how many."""
    rows = client.xpending_range(stream, INGEST_GROUP, "-", "+", 10_000, consumername=consumer)
    ids: list[Any] = [text(r["message_id"]) for r in rows]  # type: ignore[arg-type]
    if ids:
        client.xclaim(stream, INGEST_GROUP, consumer, 0, ids, idle=idle_ms, justid=True)
    return len(ids)


def task_counts(tasks: TaskStore) -> dict[tuple[str, str], int]:
    """Tasks per (principal, message_id), straight from the table (either backend)."""
    counts: dict[tuple[str, str], int] = {}
    for row in dump(tasks.db)["tasks"]:
        key = (row["principal"], row["message_id"])
        counts[key] = counts.get(key, 0) + 1
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--db", required=True)
    parser.add_argument("--consumer", required=True)
    parser.add_argument("--keyring", required=True)
    parser.add_argument("--count", type=int, default=5)
    parser.add_argument("--claim-min-idle-ms", type=int, default=60_000)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--trim", action="store_true", help="trim before every step (keep 0)")
    args = parser.parse_args(argv)

    client = connect(args.url, socket_timeout_s=5.0)
    db = open_store(args.db)  # a SQLite file or a postgresql:// URL
    config = IngestConfig(
        prefix=args.prefix,
        consumer=args.consumer,
        count=args.count,
        block_ms=20,
        claim_min_idle_ms=args.claim_min_idle_ms,
        trim_keep_s=0,
    )
    ingestor = Ingestor(config, client, TaskStore(db), Keyring.load(args.keyring))
    stream = Keys(args.prefix).inbound()
    deadline = time.monotonic() + args.timeout_s
    print("ready", flush=True)
    while time.monotonic() < deadline:
        ingestor.take_over()
        if args.trim:
            ingestor.trim()
        ingestor.step()
        if drained(client, stream):
            print(json.dumps(asdict(ingestor.stats)), flush=True)
            db.close()
            return 0
    print("did not drain", file=sys.stderr, flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main())
