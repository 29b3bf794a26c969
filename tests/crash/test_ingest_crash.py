"""SIGKILL the ingest process at each named point, restart it, and check the invariant:
exactly one task per request, an empty pending list, each bad entry dead-lettered once.

The restart is either the same consumer name (it replays its own pending list) or a new
one, which takes the dead consumer's entries over with XAUTOCLAIM. Instead of waiting out
``claim_min_idle_ms`` the test ages those entries with ``XCLAIM ... IDLE 3600000 JUSTID``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from broker_adapter.client.publisher import Publisher
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import INGEST_GROUP, Keys
from broker_adapter.protocol.signing import Keyring, signature
from broker_adapter.redis.client import connect, text
from broker_adapter.store import Database, TaskStore
from tests.support import ingest_script
from tests.support.ingest_script import (
    KEYRING,
    age_pending,
    drained,
    pending_total,
    real_deadline,
    task_counts,
    write_keyring,
)
from tests.support.redis_server import RedisServer
from tests.support.store_script import dump_path, open_any

pytestmark = pytest.mark.crash

ROOT = Path(__file__).resolve().parents[2]
# point@n: the n-th time the process passes it (batches of 5 entries; entry 3 is bad)
POINTS = [
    "ingest.after_read@2",
    "store.accept.before_commit@2",
    "ingest.after_commit@2",
    "ingest.after_xack@2",
    "ingest.after_dead_letter@1",
]


def _run(
    server: RedisServer,
    prefix: str,
    tmp_path: Path,
    db: str,
    consumer: str,
    crashpoint: str | None,
    *extra: str,
) -> subprocess.CompletedProcess[str]:
    """Run ``ingest_script`` (with ``extra`` arguments) until it drains, or is killed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BA_")}
    if crashpoint is not None:
        env["BA_CRASHPOINT"] = crashpoint
    cmd = [
        sys.executable,
        "-m",
        "tests.support.ingest_script",
        "--url",
        server.url,
        "--prefix",
        prefix,
        "--db",
        db,
        "--consumer",
        consumer,
        "--keyring",
        str(tmp_path / "keys.json"),
        "--count",
        "5",
        *extra,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


#: One deadline on the real clock (the ingest under test runs on it) for every envelope:
#: a resend is the same request only with the same deadline.
DEADLINE = real_deadline()


def envelope(message_id: str, sender: str = "alice") -> Envelope:
    """``ingest_script.envelope`` with ``DEADLINE``."""
    return ingest_script.envelope(message_id, sender, deadline=DEADLINE)


def _publish(client: redis.Redis, prefix: str, keyring: Keyring) -> set[tuple[str, str]]:
    keys = Keys(prefix)
    alice = Publisher(client, keys, "alice", keyring)
    bob = Publisher(client, keys, "bob", keyring)
    expected: set[tuple[str, str]] = set()
    for i in range(12):
        if i == 2:  # a bad entry in the first batch: bob's key, alice's name
            env = envelope("spoof").to_json()
            sig = signature(KEYRING["bob"]["bob-1"].encode(), "bob-1", env)
            client.xadd(keys.inbound(), {"v": "1", "env": env, "kid": "bob-1", "sig": sig})
        alice.publish(envelope(f"a{i}"))
        expected.add(("alice", f"a{i}"))
        if i % 3 == 0:
            bob.publish(envelope(f"b{i}", sender="bob"))
            expected.add(("bob", f"b{i}"))
    for i in range(3):
        alice.publish(envelope(f"a{i}"))  # resends
    return expected


@pytest.mark.parametrize("heir", ["same", "new"])
@pytest.mark.parametrize("point", POINTS)
def test_ingest_crash_then_restart_stores_each_request_once(
    redis_server: RedisServer,
    prefix: str,
    tmp_path: Path,
    store_target: str,
    point: str,
    heir: str,
) -> None:
    """On SQLite and on PostgreSQL (where the heir is another host's ingest meeting the
    same inbox records)."""
    client = connect(redis_server.url)
    keys = Keys(prefix)
    keyring = write_keyring(tmp_path / "keys.json")
    expected = _publish(client, prefix, keyring)

    crashed = _run(redis_server, prefix, tmp_path, store_target, "ingest-h-0", point)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr

    pending = _pending_ids(client, keys.inbound())
    if point.startswith("ingest.after_xack"):
        # Killed after its XACK: the acknowledged batch is off the pending list. What is
        # left is the next batch, read in the XACK's round trip and not handled: none of it
        # was stored, so nothing stored is left unacknowledged.
        assert not pending & _stored_entry_ids(store_target), pending
    else:
        # Killed before its XACK: the batch is still pending.
        assert pending, point

    consumer = "ingest-h-0"
    aged = 0
    if heir == "new":
        aged = age_pending(client, keys.inbound(), "ingest-h-0")
        consumer = "ingest-h-1"
    finished = _run(redis_server, prefix, tmp_path, store_target, consumer, None)
    assert finished.returncode == 0, finished.stderr

    db = open_any(store_target)
    try:
        assert task_counts(TaskStore(db)) == dict.fromkeys(expected, 1)
        if isinstance(db, Database):
            assert db.integrity_check() == "ok"
    finally:
        db.close()
    assert pending_total(client, keys.inbound()) == 0
    assert drained(client, keys.inbound())
    dead = client.xrange(keys.inbound_dead()) or []
    assert [text(f[b"dl.reason"]) for _, f in dead] == ["sender_mismatch"]  # type: ignore[index]
    if heir == "new" and aged:
        assert f'"taken_over": {aged}' in finished.stdout


def _pending_ids(client: redis.Redis, stream: str) -> set[str]:
    rows = client.xpending_range(stream, INGEST_GROUP, min="-", max="+", count=1000)
    return {text(r["message_id"]) for r in rows}  # type: ignore[arg-type]


def _stored_entry_ids(target: str) -> set[str]:
    return {row["entry_id"] for row in dump_path(target)["inbox"]}
