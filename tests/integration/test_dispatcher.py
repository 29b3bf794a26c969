"""Dispatcher against a real redis-server: idempotent publication, fencing, retries, data loss,
the operator's replay, and a script reply lost after the server ran it."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker_adapter.backoff import Backoff
from broker_adapter.clock import FakeClock
from broker_adapter.errors import RedisUnavailable, ReplyConflict, StaleError
from broker_adapter.protocol.canonical import sha256_hex
from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import connect
from broker_adapter.stages.dispatcher import Dispatcher, DispatcherConfig
from broker_adapter.stages.loss import LossEvent, parse_version
from broker_adapter.stages.publish import PUBLISH_SCRIPT
from broker_adapter.stages.replay import ReplayOutcome
from broker_adapter.store import OutboxStore, open_database
from broker_adapter.store.db import Database
from broker_adapter.store.outbox import OutboxPolicy
from tests.support.redis_server import RedisServer
from tests.support.replies_script import entries_per_reply, make_replies, reply_keyring

pytestmark = pytest.mark.integration

P = "alice"


def _dispatcher(
    server: RedisServer,
    db: Database,
    clock: FakeClock,
    prefix: str,
    owner: str = "d1",
    client: redis.Redis | None = None,
    policy: OutboxPolicy | None = None,
    **cfg: Any,
) -> Dispatcher:
    return Dispatcher(
        DispatcherConfig(prefix=prefix, owner=owner, **cfg),
        client or connect(server.url),
        OutboxStore(db, clock, policy),
        keyring=reply_keyring(),
    )


def test_dispatcher_publishes_each_reply_once_with_its_stored_bytes(
    redis_server: RedisServer, db: Database, clock: FakeClock, prefix: str
) -> None:
    ids = make_replies(db, clock, P, 3)
    d = _dispatcher(redis_server, db, clock, prefix)
    assert d.step() == 3
    client: Any = redis_server.client()
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
    redis_server: RedisServer, db: Database, clock: FakeClock, prefix: str
) -> None:
    (rid,) = make_replies(db, clock, P, 1)
    client = redis_server.client()
    client.set(Keys(prefix).reply_record(P, rid), f"{'0' * 64} 1-1")
    d = _dispatcher(redis_server, db, clock, prefix)
    assert d.step() == 0
    (dead,) = d.list_dead()
    assert dead.reply_id == rid
    assert dead.last_error is not None
    assert dead.last_error.startswith("reply_conflict")
    assert client.xlen(Keys(prefix).replies(P)) == 0
    with pytest.raises(ReplyConflict):  # the operator must resolve it by hand
        d.replay(rid, "ops")


def test_dispatcher_retries_with_backoff_then_dead_with_last_error(
    redis_server: RedisServer, db: Database, clock: FakeClock, prefix: str
) -> None:
    (rid,) = make_replies(db, clock, P, 1)
    client = redis_server.client()
    client.set(Keys(prefix).replies(P), "not a stream")  # every XADD fails: WRONGTYPE
    policy = OutboxPolicy(max_attempts=3, backoff=Backoff(base_s=1.0, cap_s=4.0))
    d = _dispatcher(redis_server, db, clock, prefix, policy=policy)
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
    redis_server: RedisServer, db: Database, clock: FakeClock, prefix: str
) -> None:
    (rid,) = make_replies(db, clock, P, 1)
    d = _dispatcher(redis_server, db, clock, prefix)
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
    assert redis_server.client().xlen(Keys(prefix).replies(P)) == 1


def test_dispatcher_stale_publisher_is_fenced_at_mark_sent(
    redis_server: RedisServer, tmp_path: Path, clock: FakeClock, prefix: str
) -> None:
    db1, db2 = open_database(tmp_path / "a.db"), open_database(tmp_path / "a.db")
    ids = make_replies(db1, clock, P, 2)
    first = _dispatcher(redis_server, db1, clock, prefix, owner="d1")
    second = _dispatcher(redis_server, db2, clock, prefix, owner="d2")
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
    assert entries_per_reply(redis_server.client(), Keys(prefix).replies(P)) == dict.fromkeys(
        ids, 1
    )
    db1.close()
    db2.close()


class _LoseReplyConnection(redis.Connection):
    """A connection that, once armed, lets the server run a pipelined EVALSHA batch and then
    closes before reading the replies (they are dropped unread): an ambiguous failure."""

    armed: ClassVar[dict[str, Any]] = {}

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        data = b"".join(command) if isinstance(command, list) else command
        if self.armed and b"EVALSHA" in bytes(data):
            self._lose = True
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_lose", False):
            self._lose = False
            hook = self.armed.pop("hook")
            hook()
            self.disconnect()  # type: ignore[no-untyped-call]  # the replies sitting in the socket buffer are lost
        return super().read_response(*args, **kwargs)


def test_dispatcher_lost_script_reply_retry_yields_one_entry(
    redis_server: RedisServer, db: Database, clock: FakeClock, prefix: str
) -> None:
    ids = make_replies(db, clock, P, 3)
    admin = redis_server.client()
    admin.script_load(PUBLISH_SCRIPT)  # so the EVALSHA runs (no NOSCRIPT round)
    name = f"lossy-{prefix}"
    pool = redis.ConnectionPool(
        connection_class=_LoseReplyConnection,
        host="127.0.0.1",
        port=redis_server.port,
        socket_timeout=5,
        retry=Retry(NoBackoff(), 0),
        client_name=name,
    )
    lossy = redis.Redis(connection_pool=pool)
    keys = Keys(prefix)

    def wait_until_the_server_ran_it() -> None:
        deadline = time.monotonic() + 5
        while admin.exists(*[keys.reply_record(P, r) for r in ids]) < len(ids):
            assert time.monotonic() < deadline, "the scripts never ran"
        (victim,) = [c for c in admin.client_list() if c.get("name") == name]
        admin.client_kill_filter(_id=victim["id"])  # and the server drops the connection

    _LoseReplyConnection.armed = {"hook": wait_until_the_server_ran_it}
    d = _dispatcher(redis_server, db, clock, prefix, client=lossy)
    with pytest.raises(RedisUnavailable):
        d.step()
    assert {r.state for r in d.outbox.list()} == {"pending"}  # not confirmed: retry later
    assert admin.xlen(keys.replies(P)) == 3  # ... although the server did publish
    clock.advance(60)
    assert d.step() == 3
    assert d.stats.already_published == 3
    assert entries_per_reply(admin, keys.replies(P)) == dict.fromkeys(ids, 1)
    pool.disconnect()


def test_dispatcher_wipe_alarm_requeues_all_sent_and_sets_new_epoch(
    fresh_redis: RedisServer,
    db: Database,
    clock: FakeClock,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ids = make_replies(db, clock, P, 3)
    d = _dispatcher(fresh_redis, db, clock, prefix)
    assert d.step() == 3
    old_epoch = d.watch().epoch
    fresh_redis.restart(wipe=True)
    with caplog.at_level(logging.ERROR, logger="broker_adapter.stages.dispatcher"):
        watch = _until_ok(d.watch)
    assert (watch.event, watch.requeued) == (LossEvent.WIPE, 3)
    assert watch.epoch != old_epoch
    assert any("ALARM" in r.getMessage() for r in caplog.records)
    assert d.step() == 3
    client = fresh_redis.client()
    assert client.get(Keys(prefix).epoch()) == watch.epoch.encode()
    assert entries_per_reply(client, Keys(prefix).replies(P)) == dict.fromkeys(ids, 1)
    # a dispatcher that starts after a wipe notices it too: no epoch key, sent rows
    fresh_redis.restart(wipe=True)
    late = _dispatcher(fresh_redis, db, clock, prefix, owner="d2")
    assert _until_ok(late.watch).event is LossEvent.WIPE
    assert late.step() == 3
    assert entries_per_reply(client, Keys(prefix).replies(P)) == dict.fromkeys(ids, 1)


def test_dispatcher_restart_requeues_loss_window_and_adds_no_entries(
    fresh_redis: RedisServer, db: Database, clock: FakeClock, prefix: str
) -> None:
    old = make_replies(db, clock, P, 2)
    d = _dispatcher(fresh_redis, db, clock, prefix)
    assert d.step() == 2
    clock.advance(60)  # these two are long fsynced
    recent = make_replies(db, clock, P, 2, first=2)
    assert d.step() == 2
    fresh_redis.restart()  # AOF always: nothing lost, but the dispatcher cannot know
    watch = _until_ok(d.watch)
    assert (watch.event, watch.requeued) == (LossEvent.RESTART, 2)
    assert {r.reply_id for r in d.outbox.list("pending")} == set(recent)
    assert d.step() == 2
    assert d.stats.already_published == 2  # the surviving records make the resend a no-op
    assert entries_per_reply(fresh_redis.client(), Keys(prefix).replies(P)) == dict.fromkeys(
        old + recent, 1
    )


def _until_ok(fn: Any, attempts: int = 5) -> Any:
    """Call ``fn``; the first call after a server restart may meet the dead connection."""
    for _ in range(attempts - 1):
        try:
            return fn()
        except RedisUnavailable:
            continue
    return fn()


def test_dispatcher_run_publishes_until_stopped(
    redis_server: RedisServer, db: Database, clock: FakeClock, prefix: str
) -> None:
    ids = make_replies(db, clock, P, 5)
    d = _dispatcher(redis_server, db, clock, prefix, batch=2, idle_poll_s=0.01)
    stop = threading.Event()
    worker = threading.Thread(target=d.run, args=(stop,))
    worker.start()
    deadline = time.monotonic() + 10
    while d.outbox.counts()["sent"] < len(ids):  # poll the condition, with a timeout
        assert time.monotonic() < deadline, "run() did not publish everything"
    stop.set()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert entries_per_reply(redis_server.client(), Keys(prefix).replies(P)) == dict.fromkeys(
        ids, 1
    )
