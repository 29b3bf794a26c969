"""Fences at the target: a zombie's late write is refused by the resource itself, in a real
SQLite file (``fences.SqlFence``) and a real redis-server (``redis.fences.fenced_set``)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import redis

from broker_adapter.clock import FakeClock
from broker_adapter.errors import BrokerAdapterError, StaleError
from broker_adapter.fences import SqlFence, TargetFenced
from broker_adapter.redis.fences import FENCE_LIMIT, fenced_set, highest_fence
from broker_adapter.store import open_database
from broker_adapter.store.tasks import TaskStore
from tests.support.store_script import LEASE_S, T0, item, task_policy

FENCE = SqlFence()


def target(path: Path) -> sqlite3.Connection:
    """One writer's own connection to the target's database file."""
    conn = sqlite3.connect(path, timeout=10)
    conn.execute(FENCE.create_sql())
    conn.execute("CREATE TABLE IF NOT EXISTS servers (name TEXT PRIMARY KEY, state TEXT)")
    return conn


def write_state(conn: sqlite3.Connection, key: str, fence: int, state: str) -> None:
    """The effect: the fence check and the write in one transaction of the target."""
    with conn:
        FENCE.advance(conn.cursor(), key, fence)
        conn.execute("INSERT OR REPLACE INTO servers (name, state) VALUES ('web1', ?)", (state,))


def server_state(path: Path) -> str:
    with sqlite3.connect(path) as conn:
        return str(conn.execute("SELECT state FROM servers WHERE name = 'web1'").fetchone()[0])


def test_sqlite_zombie_with_fence_4_is_refused_after_fence_5(tmp_path: Path) -> None:
    path = tmp_path / "target.db"
    current, zombie = target(path), target(path)
    write_state(current, "task-1", 5, "restarted by fence 5")
    with pytest.raises(TargetFenced) as refused:
        write_state(zombie, "task-1", 4, "restarted by the zombie")
    assert (refused.value.fence, refused.value.highest) == (4, 5)
    assert server_state(path) == "restarted by fence 5"  # the zombie's write rolled back
    assert FENCE.highest(current.cursor(), "task-1") == 5
    current.close()
    zombie.close()


def test_sqlite_zombie_of_a_real_claim_is_refused_at_the_target(tmp_path: Path) -> None:
    """The fences come from the task store: a worker frozen past its lease (fence 1) wakes
    after the task was claimed again (fence 2) and written; its late effect is refused."""
    clock = FakeClock(T0)
    with open_database(tmp_path / "inbox.db") as db:
        tasks = TaskStore(db, clock, task_policy())
        tasks.accept([item("m1")])
        (first,) = tasks.claim("frozen")
        clock.advance(LEASE_S + 1)
        (second,) = tasks.claim("alive")
        assert (first.task_id, first.fence + 1) == (second.task_id, second.fence)
        path = tmp_path / "target.db"
        alive, frozen = target(path), target(path)
        write_state(alive, second.task_id, second.fence, "by alive")
        tasks.finish(second.task_id, "alive", second.fence, {"ok": True})
        with pytest.raises(TargetFenced):
            write_state(frozen, first.task_id, first.fence, "by the zombie")
        with pytest.raises(StaleError):  # and our own commit refuses it too
            tasks.finish(first.task_id, "frozen", first.fence, {"ok": False})
        assert server_state(path) == "by alive"
        alive.close()
        frozen.close()


def test_redis_zombie_with_fence_4_is_refused_after_fence_5(
    redis_client: redis.Redis, prefix: str
) -> None:
    key, fence_key = f"{prefix}:web1:state", f"{prefix}:web1:state:fence:task-1"
    fenced_set(redis_client, key, "restarted by fence 5", 5, fence_key=fence_key)
    with pytest.raises(TargetFenced) as refused:
        fenced_set(redis_client, key, "restarted by the zombie", 4, fence_key=fence_key)
    assert (refused.value.key, refused.value.fence, refused.value.highest) == (fence_key, 4, 5)
    assert redis_client.get(key) == b"restarted by fence 5"
    assert highest_fence(redis_client, fence_key) == 5
    fenced_set(redis_client, key, "again by fence 5", 5, fence_key=fence_key)  # equal: same attempt
    fenced_set(redis_client, key, "by fence 6", 6, fence_key=fence_key)
    assert redis_client.get(key) == b"by fence 6"
    assert highest_fence(redis_client, fence_key) == 6


def test_redis_fences_per_key_and_expiry(redis_client: redis.Redis, prefix: str) -> None:
    key = f"{prefix}:v"
    fenced_set(redis_client, key, "a", 9, fence_key=f"{prefix}:fence:task-a")
    fenced_set(redis_client, key, "b", 1, fence_key=f"{prefix}:fence:task-b")  # another task
    assert redis_client.get(key) == b"b"
    fenced_set(redis_client, key, "c", 10, fence_key=f"{prefix}:fence:task-a", px_ms=60_000)
    ttl = redis_client.pttl(key)
    assert isinstance(ttl, int)
    assert 0 < ttl <= 60_000
    assert redis_client.ttl(f"{prefix}:fence:task-a") == -1  # the fence record never expires
    assert highest_fence(redis_client, f"{prefix}:fence:none") is None


def test_redis_refuses_a_fence_key_that_holds_no_number(
    redis_client: redis.Redis, prefix: str
) -> None:
    redis_client.set(f"{prefix}:fence", "not a number")
    with pytest.raises(BrokerAdapterError, match="holds no number"):
        fenced_set(redis_client, f"{prefix}:v", "x", 1, fence_key=f"{prefix}:fence")
    assert redis_client.get(f"{prefix}:v") is None


@pytest.mark.parametrize("bad", [-1, FENCE_LIMIT, True])
def test_redis_refuses_what_is_not_a_fence(
    redis_client: redis.Redis, prefix: str, bad: int
) -> None:
    with pytest.raises(ValueError, match="fence"):
        fenced_set(redis_client, f"{prefix}:v", "x", bad, fence_key=f"{prefix}:f")
    assert redis_client.get(f"{prefix}:v") is None
