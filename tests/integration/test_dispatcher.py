"""The dispatcher against a real redis-server's faults: data loss (a wipe, a restart) and a
script reply lost after the server ran it. Its contract (tests/contract/test_dispatcher.py)
runs on fakeredis too."""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker_adapter.clock import FakeClock
from broker_adapter.errors import RedisUnavailable
from broker_adapter.protocol.keys import Keys
from broker_adapter.stages.dispatch.loss import LossEvent
from broker_adapter.stages.shared.publish import PUBLISH_SCRIPT
from broker_adapter.store.db import Database
from tests.support.backends import real_backend
from tests.support.redis_server import RedisServer
from tests.support.replies_script import entries_per_reply, make_dispatcher, make_replies

pytestmark = pytest.mark.integration

P = "alice"


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
    d = make_dispatcher(real_backend(redis_server), db, clock, prefix, client=lossy)
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
    d = make_dispatcher(real_backend(fresh_redis), db, clock, prefix)
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
    late = make_dispatcher(real_backend(fresh_redis), db, clock, prefix, owner="d2")
    assert _until_ok(late.watch).event is LossEvent.WIPE
    assert late.step() == 3
    assert entries_per_reply(client, Keys(prefix).replies(P)) == dict.fromkeys(ids, 1)


def test_dispatcher_restart_requeues_loss_window_and_adds_no_entries(
    fresh_redis: RedisServer, db: Database, clock: FakeClock, prefix: str
) -> None:
    old = make_replies(db, clock, P, 2)
    d = make_dispatcher(real_backend(fresh_redis), db, clock, prefix)
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
