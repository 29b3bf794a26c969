"""The reply path under real SIGKILLs and Redis restarts and wipes.

Each crash case runs one dispatcher or receiver step in a subprocess armed with a crash
point, checks that it died by SIGKILL, reopens the databases, recovers in process, and ends
with the same invariant: one reply entry per reply id on the stream and exactly one receiver
effect per terminal task, with nothing left pending.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.errors import RedisUnavailable
from broker_adapter.protocol.keys import Keys
from broker_adapter.store import OutboxStore
from broker_adapter.store.outbox_types import OutboxPolicy
from tests.support.postgres import STORE_BACKENDS, ThrowawayDatabase
from tests.support.redis_server import RedisServer
from tests.support.replies_script import (
    dispatcher_for,
    drain,
    effect_counts,
    entries_per_reply,
    make_replies,
    receiver_for,
    run_worker,
)
from tests.support.store_script import open_any

pytestmark = pytest.mark.crash

P = "alice"
N = 3


@dataclass
class Scene:
    server: RedisServer
    prefix: str
    clock: FakeClock
    agent_path: str  # a SQLite file or a postgresql:// URL, as rx_path
    rx_path: str
    reply_ids: list[str]

    def args(self, db: str, **extra: str) -> list[str]:
        out = ["--url", self.server.url, "--db", str(db), "--prefix", self.prefix]
        out += ["--now", repr(self.clock.now()), "--principal", P]
        for name, value in extra.items():
            out += [f"--{name}", value]
        return out

    def crash(self, role: str, point: str, db: str, **extra: str) -> None:
        proc = run_worker(role, self.args(db, **extra), crashpoint=point)
        assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)

    def dispatch(self) -> int:
        with open_any(self.agent_path) as db:
            return dispatcher_for(self.server.url, db, self.clock, self.prefix, "d-rec").step()

    def receive(self, consumer: str = "r1", **cfg: int) -> int:
        with open_any(self.rx_path) as db:
            rc = receiver_for(self.server.url, db, self.clock, self.prefix, P, consumer, **cfg)
            return drain(rc)

    def assert_exactly_once(self) -> None:
        client = self.server.client()
        stream = Keys(self.prefix).replies(P)
        assert entries_per_reply(client, stream) == dict.fromkeys(self.reply_ids, 1)
        assert effect_counts(self.rx_path) == dict.fromkeys(self.reply_ids, 1)
        assert client.xpending(stream, "ba-receiver")["pending"] == 0
        with open_any(self.agent_path) as db:
            rows = OutboxStore(db, self.clock).list()
        assert {r.reply_id: r.state for r in rows} == dict.fromkeys(self.reply_ids, "sent")


def _scene(server: RedisServer, prefix: str, where: tuple[str, str]) -> Scene:
    clock = FakeClock()
    agent_path, rx_path = where
    with open_any(agent_path) as db:
        ids = make_replies(db, clock, P, N)
    return Scene(server, prefix, clock, agent_path, rx_path, ids)


@pytest.fixture(params=STORE_BACKENDS)
def databases(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """The adapter's and the receiver's databases: two SQLite files, or two PostgreSQL
    schemas."""
    if request.param == "sqlite":
        return str(tmp_path / "agent.db"), str(tmp_path / "receiver.db")
    pg: ThrowawayDatabase = request.getfixturevalue("pg_database")
    return pg.fresh_schema(), pg.fresh_schema()


@pytest.fixture
def scene(redis_server: RedisServer, prefix: str, databases: tuple[str, str]) -> Scene:
    return _scene(redis_server, prefix, databases)


def _outbox_states(scene: Scene) -> dict[str, str]:
    with open_any(scene.agent_path) as db:
        return {r.reply_id: r.state for r in OutboxStore(db, scene.clock).list()}


def _stream_len(scene: Scene) -> int:
    return int(scene.server.client().xlen(Keys(scene.prefix).replies(P)))


def _reclaim_after_lease(scene: Scene) -> None:
    scene.clock.advance(OutboxPolicy().lease_s + 1)


def test_dispatcher_killed_before_xadd_publishes_after_lease(scene: Scene) -> None:
    scene.crash("dispatch", "dispatcher.before_xadd", scene.agent_path)
    assert set(_outbox_states(scene).values()) == {"sending"}
    assert _stream_len(scene) == 0
    _reclaim_after_lease(scene)
    assert scene.dispatch() == N
    assert scene.receive() == N
    scene.assert_exactly_once()


def test_dispatcher_killed_after_xadd_before_mark_sent_adds_no_second_entry(
    scene: Scene,
) -> None:
    scene.crash("dispatch", "dispatcher.after_xadd", scene.agent_path)
    assert set(_outbox_states(scene).values()) == {"sending"}
    assert _stream_len(scene) == N  # published, not confirmed
    _reclaim_after_lease(scene)
    assert scene.dispatch() == N  # the records return the earlier entry ids
    assert scene.receive() == N
    scene.assert_exactly_once()


def test_dispatcher_killed_after_mark_sent_leaves_nothing_to_do(scene: Scene) -> None:
    scene.crash("dispatch", "dispatcher.after_mark_sent", scene.agent_path)
    assert set(_outbox_states(scene).values()) == {"sent"}
    _reclaim_after_lease(scene)
    scene.dispatch()
    assert _stream_len(scene) == N
    assert scene.receive() == N
    scene.assert_exactly_once()


def test_receiver_killed_before_commit_applies_once_on_restart(scene: Scene) -> None:
    assert scene.dispatch() == N
    scene.crash("receive", "receiver.before_commit", scene.rx_path, consumer="r1")
    assert effect_counts(scene.rx_path) == {}
    assert scene.receive("r1") == N  # same consumer name: own pending replayed first
    scene.assert_exactly_once()


def test_receiver_killed_after_commit_before_xack_skips_the_effect(scene: Scene) -> None:
    assert scene.dispatch() == N
    scene.crash("receive", "receiver.after_commit", scene.rx_path, consumer="r1")
    assert effect_counts(scene.rx_path) == dict.fromkeys(scene.reply_ids, 1)
    client = scene.server.client()
    assert client.xpending(Keys(scene.prefix).replies(P), "ba-receiver")["pending"] == N
    # another consumer takes the dead one's entries over; all are duplicates now
    assert scene.receive("r2", claim_min_idle_ms=0) == N
    scene.assert_exactly_once()


def test_receiver_killed_after_xack_leaves_nothing_to_do(scene: Scene) -> None:
    assert scene.dispatch() == N
    scene.crash("receive", "receiver.after_xack", scene.rx_path, consumer="r1")
    assert scene.receive("r1") == 0
    scene.assert_exactly_once()


def _retrying(fn: object) -> int:
    """Run a step; the first call after a server restart may meet the dead connection."""
    assert callable(fn)
    for _ in range(4):
        try:
            return int(fn())
        except RedisUnavailable:
            continue
    return int(fn())


def test_replies_survive_redis_restart_with_aof(
    fresh_redis: RedisServer, prefix: str, databases: tuple[str, str]
) -> None:
    scene = _scene(fresh_redis, prefix, databases)
    with open_any(scene.agent_path) as agent, open_any(scene.rx_path) as rx:
        d = dispatcher_for(fresh_redis.url, agent, scene.clock, prefix, "d1")
        assert d.step() == N
        stream = Keys(prefix).replies(P)
        client = fresh_redis.client()
        client.xgroup_create(stream, "ba-receiver", id="0")
        # receiver r1 read the replies and died before applying them: pending ...
        client.xreadgroup("ba-receiver", "r1", {stream: ">"})
        scene.reply_ids += make_replies(agent, scene.clock, P, 2, first=N)
        fresh_redis.restart()  # ... in a PEL that the AOF restores
        assert _retrying(d.step) == 5  # restart noticed; the resends find their records
        assert d.stats.restarts == 1
        rc = receiver_for(fresh_redis.url, rx, scene.clock, prefix, P, "r1")
        assert drain(rc) == 5
        assert rc.reader.stats.replayed == N
    scene.assert_exactly_once()


def test_replies_resent_after_redis_wipe_still_one_effect_each(
    fresh_redis: RedisServer, prefix: str, databases: tuple[str, str]
) -> None:
    scene = _scene(fresh_redis, prefix, databases)
    with open_any(scene.agent_path) as agent, open_any(scene.rx_path) as rx:
        d = dispatcher_for(fresh_redis.url, agent, scene.clock, prefix, "d1")
        rc = receiver_for(fresh_redis.url, rx, scene.clock, prefix, P, "r1")
        assert d.step() == N
        assert drain(rc) == N
        fresh_redis.restart(wipe=True)  # stream, group, records and epoch all gone
        assert _retrying(d.step) == N  # ALARM: every sent reply published again
        assert d.stats.wipes == 1
        assert _retrying(lambda: drain(rc)) == N  # group recreated from 0; all duplicates
        assert rc.reader.stats.group_recreated == 1
        assert rc.stats.duplicates == N
    scene.assert_exactly_once()  # one entry per reply id on the post-wipe stream
