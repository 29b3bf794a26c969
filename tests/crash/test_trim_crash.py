"""An ingest killed between read and XACK while trims run (its own, and another ingest's):
trimming never removes an entry that is pending, and every request is stored once."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import connect, text
from broker_adapter.redis.trimming import trim_stream
from broker_adapter.store import TaskStore, open_database
from tests.crash.test_ingest_crash import _pending_ids, _publish
from tests.crash.test_ingest_crash import _run as run_ingest
from tests.support.ingest_script import drained, task_counts, write_keyring
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.crash

ROOT = Path(__file__).resolve().parents[2]


def _run(
    server: RedisServer,
    prefix: str,
    tmp_path: Path,
    consumer: str,
    point: str | None,
    *extra: str,
) -> subprocess.CompletedProcess[str]:
    """``test_ingest_crash``'s run of ``ingest_script`` on a SQLite inbox in ``tmp_path``,
    trimming before every step."""
    db = str(tmp_path / "inbox.db")
    return run_ingest(server, prefix, tmp_path, db, consumer, point, "--trim", *extra)


def _key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


# after_read: a batch read, not acknowledged. after_trim@3: the first batch acknowledged,
# the second read ahead in the XACK's round trip (pending), then a trim, then the kill.
@pytest.mark.parametrize("point", ["ingest.after_read@2", "ingest.after_trim@3"])
def test_trims_keep_a_killed_ingests_pending_entries(
    redis_server: RedisServer, prefix: str, tmp_path: Path, point: str
) -> None:
    client: Any = connect(redis_server.url)
    stream = Keys(prefix).inbound()
    expected = _publish(client, prefix, write_keyring(tmp_path / "keys.json"))
    crashed = _run(redis_server, prefix, tmp_path, "ingest-h-0", point)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    pending = _pending_ids(client, stream)
    assert pending
    # Another ingest trims before each of its steps and reads everything else; the dead
    # consumer's entries are not idle long enough to take over, so it cannot drain.
    other = _run(redis_server, prefix, tmp_path, "ingest-h-1", None, "--timeout-s", "2")
    assert other.returncode == 3, other.stderr
    oldest = min(pending, key=_key)
    ids = [text(eid) for eid, fields in client.xrange(stream) if fields]
    assert pending <= set(ids)  # every pending entry is still there, with its fields
    assert ids[0] == oldest  # and the trim went up to the oldest of them, not further back

    restarted = _run(redis_server, prefix, tmp_path, "ingest-h-0", None)
    assert restarted.returncode == 0, restarted.stderr
    assert drained(client, stream)
    db = open_database(tmp_path / "inbox.db")
    try:
        assert task_counts(TaskStore(db)) == dict.fromkeys(expected, 1)
    finally:
        db.close()
    dead = client.xrange(Keys(prefix).inbound_dead()) or []
    assert [text(f[b"dl.reason"]) for _, f in dead] == ["sender_mismatch"]
    trim_stream(client, stream, keep_from_ms=10**13)
    assert client.xlen(stream) == 1  # all acknowledged: only the last delivered entry stays
