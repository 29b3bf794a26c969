"""A network partition longer than a lease: a worker cut off from the target (a TCP proxy
that swallows every byte, then aborts the connection) while its lease runs out. Another
worker takes the task (fence + 1), writes the effect and commits; when the partition heals,
the cut-off worker's write (its client sends it again on a new connection) is refused by
the target's fence, and its renewal and commit are refused by the store. One effect, one
terminal state, one reply.

The store is a SQLite file on the worker's host, so the partition cannot cut the worker's
renewals; the lease runs out on the injected clock while the worker is cut off, as it does
when a partition also cuts the worker off from a PostgreSQL store (its renewals then fail
for as long). The target is a real redis-server behind the proxy
(``redis.fences.fenced_set``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker_adapter.clock import FakeClock
from broker_adapter.errors import RedisUnavailable, StaleError
from broker_adapter.fences import TargetFenced
from broker_adapter.redis.fences import fenced_set, highest_fence
from broker_adapter.store import OutboxStore, open_database
from broker_adapter.store.tasks import TaskStore
from tests.chaos.proxy import ChaosProxy
from tests.support.cli import wait_for
from tests.support.redis_server import RedisServer
from tests.support.store_script import LEASE_S, T0, item, task_policy

pytestmark = pytest.mark.integration


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[ChaosProxy]:
    chaos = ChaosProxy(redis_server.port)
    chaos.start()
    yield chaos
    chaos.stop()


def test_a_partition_longer_than_the_lease_fences_the_zombie_at_the_target_and_the_store(
    redis_server: RedisServer, proxy: ChaosProxy, prefix: str, tmp_path: Path
) -> None:
    clock = FakeClock(T0)
    with open_database(tmp_path / "inbox.db") as db:
        tasks = TaskStore(db, clock, task_policy())
        tasks.accept([item("m1")])
        (cut_off,) = tasks.claim("cut-off")
        key = f"{prefix}:web1:state"
        fence_key = f"{prefix}:web1:state:fence:{cut_off.task_id}"
        far: redis.Redis = redis.Redis(port=proxy.port, socket_timeout=30)
        near: redis.Redis = redis_server.client()
        fenced_set(far, f"{prefix}:warm", "x", 0, fence_key=f"{prefix}:warm:fence")  # script cached
        proxy.blackhole()  # the partition begins
        outcome: dict[str, BaseException | None] = {}

        def effect() -> None:  # the cut-off worker's write: never reaches the target
            try:
                fenced_set(far, key, "by the cut-off worker", cut_off.fence, fence_key=fence_key)
                outcome["first"] = None
            except BaseException as exc:  # noqa: BLE001 - inspected below
                outcome["first"] = exc

        writer = threading.Thread(target=effect)
        writer.start()
        wait_for(lambda: proxy.stats["swallowed"] > 0, "the write sent into the partition")
        clock.advance(LEASE_S + 1)  # the lease runs out while it is cut off
        (alive,) = tasks.claim("alive")  # the take-back and the new claim, fence + 1
        assert (alive.task_id, alive.fence) == (cut_off.task_id, cut_off.fence + 1)
        fenced_set(near, key, "by the live worker", alive.fence, fence_key=fence_key)
        tasks.finish(alive.task_id, "alive", alive.fence, {"by": "alive"})
        assert proxy.heal() >= 1  # the partition ends: the swallowed request is gone
        writer.join(timeout=30)
        assert not writer.is_alive()
        assert isinstance(outcome["first"], RedisUnavailable)  # it cannot know: it sends again
        with pytest.raises(TargetFenced) as refused:
            fenced_set(far, key, "by the cut-off worker", cut_off.fence, fence_key=fence_key)
        assert (refused.value.fence, refused.value.highest) == (cut_off.fence, alive.fence)
        with pytest.raises(StaleError):
            tasks.renew(cut_off.task_id, "cut-off", cut_off.fence)
        with pytest.raises(StaleError):
            tasks.finish(cut_off.task_id, "cut-off", cut_off.fence, {"by": "cut-off"})
        assert near.get(key) == b"by the live worker"
        assert highest_fence(near, fence_key) == alive.fence
        row = tasks.get(cut_off.task_id)
        assert row is not None
        assert (row.state, row.fence, row.attempts) == ("done", alive.fence, 2)
        replies = [r for r in OutboxStore(db).list(limit=10) if r.task_id == cut_off.task_id]
        assert len(replies) == 1
        far.close()
        near.close()
