"""The dispatcher's reply-stream trim and publication records against a real redis-server:
a receiver down longer than the trim interval keeps its replies until it reads them or the
retention window passes (then they are trimmed, counted and logged with their reply ids);
a stream with no group keeps entries for the window; records live min(record_ttl_s,
retention_s); the replay finds a reply in its stream once the record is gone.

The trims take the earlier of the process clock and the server's, so the ``FakeClock`` runs
a day behind the server, and entries that must age get explicit ids on that clock."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from broker_adapter.app.adapter import Adapter
from broker_adapter.app.adapter_config import AdapterConfig
from broker_adapter.clock import FakeClock
from broker_adapter.protocol.keys import RECEIVER_GROUP, Keys
from broker_adapter.redis.client import connect, text
from broker_adapter.stages.dispatch.dispatcher import Dispatcher, DispatcherConfig
from broker_adapter.stages.dispatch.replay import ReplayOutcome
from broker_adapter.store import OutboxStore
from broker_adapter.store.db import Database
from tests.support.ingest_script import write_keyring
from tests.support.redis_server import RedisServer
from tests.support.replies_script import entries_per_reply, make_replies, reply_keyring

pytestmark = pytest.mark.integration

P = "alice"
START = float(int(time.time()) - 86_400)
MS = int(START * 1000)
RETENTION_S = 100.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


def _dispatcher(
    server: RedisServer, db: Database, clock: FakeClock, prefix: str, **cfg: Any
) -> Dispatcher:
    cfg = {"retention_s": RETENTION_S, "trim_every_s": 10.0, "trim_keep_s": 0.0, **cfg}
    return Dispatcher(
        DispatcherConfig(prefix=prefix, owner="d1", **cfg),
        connect(server.url),
        OutboxStore(db, clock),
        keyring=reply_keyring(),
    )


def _seed(client: Any, stream: str, offsets_ms: list[int]) -> list[str]:
    """Reply-shaped entries at ``MS + offset`` (reply ids ``r<offset>``)."""
    return [
        text(client.xadd(stream, {"v": "2", "reply_id": f"r{o}"}, id=f"{MS + o}-0"))
        for o in offsets_ms
    ]


def _ids(client: Any, stream: str) -> list[str]:
    return [text(eid) for eid, _ in client.xrange(stream)]


def test_a_receiver_down_longer_than_the_trim_interval_keeps_its_replies_for_the_window(
    redis_server: RedisServer,
    db: Database,
    clock: FakeClock,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = _dispatcher(redis_server, db, clock, prefix)
    client: Any = connect(redis_server.url)
    stream = Keys(prefix).replies(P)
    ids = _seed(client, stream, [0, 1, 2, 3, 4])
    client.xgroup_create(stream, RECEIVER_GROUP, id="0")
    read = client.xreadgroup(RECEIVER_GROUP, "r1", {stream: ">"}, count=2)
    client.xack(stream, RECEIVER_GROUP, *[eid for eid, _ in read[0][1]])  # then it goes down
    for _ in range(10):  # 100 s of trims: what it has not read stays
        clock.advance(10.0)
        d.step()
    assert _ids(client, stream) == ids[1:]  # the last one it read, and all it has not
    clock.advance(0.0025)  # r1 (read) is past the window: trimmed, not counted as unread
    assert d.trim() == 1
    assert d.stats.unread_trimmed == 0
    with caplog.at_level(logging.WARNING, logger="broker_adapter.stages.dispatcher"):
        clock.advance(0.001)  # r2 (unread) is past the window, r3 is on its edge
        assert d.trim() == 1
    assert _ids(client, stream) == ids[3:]
    assert d.stats.unread_trimmed == 1
    assert "r2" in caplog.text
    assert "r3" not in caplog.text


def test_a_reply_stream_without_a_group_keeps_entries_for_the_window_and_dead_letters_too(
    redis_server: RedisServer, db: Database, clock: FakeClock, prefix: str
) -> None:
    d = _dispatcher(redis_server, db, clock, prefix)
    client: Any = connect(redis_server.url)
    stream, dead = Keys(prefix).replies(P), Keys(prefix).replies_dead(P)
    ids = _seed(client, stream, [0, 1])
    _seed(client, dead, [0, 1])
    clock.advance(RETENTION_S)  # r0 is exactly as old as the window: it stays
    assert d.trim() == 0
    clock.advance(0.0015)
    assert d.trim() == 2  # r0, and its twin in the dead-letter stream
    assert _ids(client, stream) == ids[1:]
    assert d.stats.dead_letters_trimmed == 1
    assert d.stats.unread_trimmed == 1


@pytest.mark.parametrize(("record_ttl_s", "retention_s"), [(30.0, 60.0), (1800.0, 60.0)])
def test_records_live_the_shorter_of_record_ttl_and_retention(
    redis_server: RedisServer,
    db: Database,
    clock: FakeClock,
    prefix: str,
    record_ttl_s: float,
    retention_s: float,
) -> None:
    (rid,) = make_replies(db, clock, P, 1)
    d = _dispatcher(
        redis_server, db, clock, prefix, record_ttl_s=record_ttl_s, retention_s=retention_s
    )
    d.step()
    window_ms = min(record_ttl_s, retention_s) * 1000
    pttl = redis_server.client().pttl(Keys(prefix).reply_record(P, rid))
    assert window_ms - 1000 < pttl <= window_ms


def test_replay_without_a_record_finds_the_reply_in_its_stream(
    redis_server: RedisServer, db: Database, clock: FakeClock, prefix: str
) -> None:
    found, trimmed = make_replies(db, clock, P, 2)
    d = _dispatcher(redis_server, db, clock, prefix)
    d.watch()  # the first look, before anything is sent (as the runner does)
    client: Any = connect(redis_server.url)
    stream = Keys(prefix).replies(P)
    rows = d.claim()
    pubs = d.publish(rows)
    entry = {pub.reply_id: pub.entry_id for pub in pubs}
    for row in rows:
        d.outbox.mark_dead(row.reply_id, "d1", row.fence, "no trusted confirmation")
        client.delete(Keys(prefix).reply_record(P, row.reply_id))  # its window is over
    client.xdel(stream, entry[trimmed])  # as if trimmed
    result = d.replay(found, "ops")
    assert (result.outcome, result.entry_id) == (ReplayOutcome.ALREADY_PUBLISHED, entry[found])
    assert d.replay(trimmed, "ops").outcome is ReplayOutcome.REQUEUED
    d.step()
    assert entries_per_reply(client, stream) == {found: 1, trimmed: 1}


def test_the_runner_gives_workers_and_dispatcher_the_same_record_window(tmp_path: Any) -> None:
    keyring = tmp_path / "keys.json"
    write_keyring(keyring)
    config = AdapterConfig(
        redis_url="redis://127.0.0.1:1/0",
        db_path=tmp_path / "a.db",
        handler="broker_adapter.examples:echo",
        keyring_path=keyring,
        retention_s=5.0,
    )
    runner = Adapter(config)
    assert runner._worker_config(0).record_ttl_s == 5.0
    assert runner._dispatcher_config().record_window_s == 5.0
    assert (
        Adapter(config.model_copy(update={"retention_s": 7 * 86_400.0}))
        ._worker_config(0)
        .record_ttl_s
        == 1800.0
    )
