"""The dispatcher's contract, on a redis-server and on fakeredis: idempotent publication,
fencing, retries, the operator's replay."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.backoff import Backoff
from broker_adapter.clock import FakeClock
from broker_adapter.errors import ReplyConflict, StaleError
from broker_adapter.protocol.canonical import sha256_hex
from broker_adapter.protocol.keys import Keys
from broker_adapter.stages.dispatch.loss import LossEvent, parse_version
from broker_adapter.stages.dispatch.replay import ReplayOutcome
from broker_adapter.store import open_database
from broker_adapter.store.db import Database
from broker_adapter.store.outbox_types import OutboxPolicy
from tests.support.backends import Backend
from tests.support.replies_script import (
    entries_per_reply,
    make_dispatcher,
    make_replies,
    reply_keyring,
)

P = "alice"


def test_dispatcher_publishes_each_reply_once_with_its_stored_bytes(
    backend: Backend, db: Database, clock: FakeClock, prefix: str
) -> None:
    ids = make_replies(db, clock, P, 3)
    d = make_dispatcher(backend, db, clock, prefix)
    assert d.step() == 3
    client: Any = backend.client()
    entries = client.xrange(Keys(prefix).replies(P))
    rows = {r.reply_id: r for r in d.outbox.list()}
    assert sorted(f[b"reply_id"].decode() for _, f in entries) == sorted(ids)
    for eid, fields in entries:
        row = rows[fields[b"reply_id"].decode()]
        assert fields[b"v"] == b"2"
        assert fields[b"body"] == row.body
        # signed for the principal with its first key: the signature the receiver checks
        assert (fields[b"kid"].decode(), fields[b"sig"].decode()) == reply_keyring().sign_reply(
            P, row.reply_id, row.body
        )
        assert fields[b"kid"] == b"alice-r2"
        assert fields[b"hash"].decode() == row.content_hash == sha256_hex(fields[b"body"])
        assert (row.state, row.entry_id) == ("sent", eid.decode())
        record = client.get(Keys(prefix).reply_record(P, row.reply_id))
        assert record == f"{row.content_hash} {eid.decode()}".encode()
        assert 0 < client.ttl(Keys(prefix).reply_record(P, row.reply_id)) <= 7 * 86_400
    assert d.stats.published == 3
    assert d.redis_version is not None
    assert d.idmp_supported is (parse_version(d.redis_version)[:2] >= (8, 6))
    # a resend of everything (as after a restart) adds nothing and keeps the entry ids
    assert d.outbox.requeue_sent(None) == 3
    assert d.step() == 3
    assert d.stats.already_published == 3
    assert entries_per_reply(client, Keys(prefix).replies(P)) == dict.fromkeys(ids, 1)
    assert {r.reply_id: r.entry_id for r in d.outbox.list()} == {
        k: v.entry_id for k, v in rows.items()
    }


def test_dispatcher_marks_dead_on_content_conflict(
    backend: Backend, db: Database, clock: FakeClock, prefix: str
) -> None:
    (rid,) = make_replies(db, clock, P, 1)
    client = backend.client()
    client.set(Keys(prefix).reply_record(P, rid), f"{'0' * 64} 1-1")
    d = make_dispatcher(backend, db, clock, prefix)
    assert d.step() == 0
    (dead,) = d.list_dead()
    assert dead.reply_id == rid
    assert dead.last_error is not None
    assert dead.last_error.startswith("reply_conflict")
    assert client.xlen(Keys(prefix).replies(P)) == 0
    with pytest.raises(ReplyConflict):  # the operator must resolve it by hand
        d.replay(rid, "ops")


def test_dispatcher_retries_with_backoff_then_dead_with_last_error(
    backend: Backend, db: Database, clock: FakeClock, prefix: str
) -> None:
    (rid,) = make_replies(db, clock, P, 1)
    client = backend.client()
    client.set(Keys(prefix).replies(P), "not a stream")  # every XADD fails: WRONGTYPE
    policy = OutboxPolicy(max_attempts=3, backoff=Backoff(base_s=1.0, cap_s=4.0))
    d = make_dispatcher(backend, db, clock, prefix, policy=policy)
    assert d.step() == 0
    row = d.outbox.get(rid)
    assert row is not None
    assert (row.state, row.attempts) == ("pending", 1)
    assert "WRONGTYPE" in (row.last_error or "")
    assert d.step() == 0  # still backing off: not claimed
    assert d.outbox.list("pending") == [row]
    for _ in range(2):
        clock.advance(5)
        assert d.step() == 0
    row = d.outbox.get(rid)
    assert row is not None
    assert (row.state, row.attempts) == ("dead", 3)
    assert [r.reply_id for r in d.list_dead()] == [rid]
    # operator: nothing in Redis for this reply, so it goes back in line and is published
    client.delete(Keys(prefix).replies(P))
    result = d.replay(rid, "ops-jane")
    assert result.outcome is ReplayOutcome.REQUEUED
    assert d.step() == 1
    row = d.outbox.get(rid)
    assert row is not None
    assert (row.state, row.replays, row.replayed_by) == ("sent", 1, "ops-jane")
    assert entries_per_reply(client, Keys(prefix).replies(P)) == {rid: 1}


def test_dispatcher_replay_of_dead_reply_already_published_marks_it_sent(
    backend: Backend, db: Database, clock: FakeClock, prefix: str
) -> None:
    (rid,) = make_replies(db, clock, P, 1)
    d = make_dispatcher(backend, db, clock, prefix)
    (row,) = d.claim()
    (pub,) = d.publish([row])  # published ...
    d.outbox.mark_dead(rid, "d1", row.fence, "no trusted confirmation")  # ... but went dead
    result = d.replay(rid, "ops-joe")
    assert (result.outcome, result.entry_id) == (ReplayOutcome.ALREADY_PUBLISHED, pub.entry_id)
    after = d.outbox.get(rid)
    assert after is not None
    assert (after.state, after.entry_id, after.replayed_by) == ("sent", pub.entry_id, "ops-joe")
    assert after.replayed_at == clock.now()
    with pytest.raises(StaleError):  # only dead rows are replayed
        d.replay(rid, "ops-joe")
    assert backend.client().xlen(Keys(prefix).replies(P)) == 1


def test_dispatcher_stale_publisher_is_fenced_at_mark_sent(
    backend: Backend, tmp_path: Path, clock: FakeClock, prefix: str
) -> None:
    db1, db2 = open_database(tmp_path / "a.db"), open_database(tmp_path / "a.db")
    ids = make_replies(db1, clock, P, 2)
    first = make_dispatcher(backend, db1, clock, prefix, owner="d1")
    second = make_dispatcher(backend, db2, clock, prefix, owner="d2")
    rows = first.claim()
    pubs = first.publish(rows)  # published, then stalls past its lease
    clock.advance(first.outbox.policy.lease_s + 1)
    assert second.step() == 2  # re-claimed with fence+1; the records give the same entries
    assert second.stats.already_published == 2
    assert first.settle(rows, pubs) == 0  # the zombie's mark is refused
    assert first.stats.fenced == 2
    for row, pub in zip(rows, pubs, strict=True):
        now = second.outbox.get(row.reply_id)
        assert now is not None
        assert (now.state, now.fence, now.entry_id) == ("sent", row.fence + 1, pub.entry_id)
    assert entries_per_reply(backend.client(), Keys(prefix).replies(P)) == dict.fromkeys(ids, 1)
    db1.close()
    db2.close()


def test_dispatcher_run_publishes_until_stopped(
    backend: Backend, db: Database, clock: FakeClock, prefix: str
) -> None:
    ids = make_replies(db, clock, P, 5)
    d = make_dispatcher(backend, db, clock, prefix, batch=2, idle_poll_s=0.01)
    stop = threading.Event()
    worker = threading.Thread(target=d.run, args=(stop,))
    worker.start()
    deadline = time.monotonic() + 10
    while d.outbox.counts()["sent"] < len(ids):  # poll the condition, with a timeout
        assert time.monotonic() < deadline, "run() did not publish everything"
    stop.set()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert entries_per_reply(backend.client(), Keys(prefix).replies(P)) == dict.fromkeys(ids, 1)


def test_dispatcher_watch_sees_a_wipe_by_the_epoch_key(
    backend: Backend, db: Database, clock: FakeClock, prefix: str
) -> None:
    """A wipe of this prefix's keys (the epoch key, the stream, the records) puts every sent
    reply back in line and they are published once more, once each."""
    ids = make_replies(db, clock, P, 3)
    d = make_dispatcher(backend, db, clock, prefix)
    first = d.watch()
    assert (first.event, first.requeued) == (LossEvent.NONE, 0)
    assert d.step() == 3
    keys = Keys(prefix)
    client = backend.client()
    client.delete(keys.epoch(), keys.replies(P), *[keys.reply_record(P, r) for r in ids])
    watch = d.watch()
    assert (watch.event, watch.requeued) == (LossEvent.WIPE, 3)
    assert watch.epoch != first.epoch
    assert client.get(keys.epoch()) == watch.epoch.encode()
    assert d.step() == 3
    assert entries_per_reply(client, keys.replies(P)) == dict.fromkeys(ids, 1)


@pytest.mark.fakeredis_differs(
    "no INFO command: the loss watch gets no run_id (a restart goes unseen, only a wipe"
    " by the epoch key) and no redis_version"
)
def test_dispatcher_watch_reads_the_servers_run_id_and_version(
    backend: Backend, db: Database, clock: FakeClock, prefix: str
) -> None:
    d = make_dispatcher(backend, db, clock, prefix)
    watch = d.watch()
    assert watch.run_id != ""
    assert d.redis_version is not None
    assert parse_version(d.redis_version)[0] > 0
