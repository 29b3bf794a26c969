"""``trimming.trim_stream`` against a real redis-server: the bound never passes an entry that
any group has not been delivered or still has pending; the time windows on both sides of
their edge. Entries get explicit ids (``<second>000-0``) so that times are exact."""

from __future__ import annotations

from typing import Any

import pytest

from broker_adapter.redis import trimming
from broker_adapter.redis.client import connect, text
from broker_adapter.redis.trimming import trim_by_age, trim_stream
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration


NONE_KEPT = 10**13  # a keep floor in the far future: the floor keeps nothing


@pytest.fixture
def client(redis_server: RedisServer) -> Any:
    c = connect(redis_server.url)
    yield c
    c.close()


def _fill(client: Any, stream: str, n: int, *, reply_ids: bool = False) -> list[str]:
    """Entries ``1000-0``, ``2000-0``, ... (``reply_id`` ``r1``, ``r2``, ... if asked)."""
    ids = []
    for i in range(1, n + 1):
        fields = {"reply_id": f"r{i}"} if reply_ids else {"n": str(i)}
        ids.append(text(client.xadd(stream, fields, id=f"{i * 1000}-0")))
    return ids


def _ids(client: Any, stream: str) -> list[str]:
    return [text(eid) for eid, _ in client.xrange(stream)]


def _read(client: Any, stream: str, group: str, consumer: str, n: int) -> list[str]:
    reply = client.xreadgroup(group, consumer, {stream: ">"}, count=n)
    return [text(eid) for eid, _ in reply[0][1]] if reply else []


def _read_and_ack(client: Any, stream: str, group: str, n: int) -> None:
    client.xack(stream, group, *_read(client, stream, group, "c", n))


def test_a_stream_without_groups_is_not_trimmed(client: Any, prefix: str) -> None:
    stream = f"{prefix}:s"
    _fill(client, stream, 5)
    assert trim_stream(client, stream, keep_from_ms=NONE_KEPT).trimmed == 0
    assert len(_ids(client, stream)) == 5
    assert trim_stream(client, f"{prefix}:missing", keep_from_ms=NONE_KEPT).trimmed == 0


def test_a_group_created_at_zero_that_read_nothing_keeps_everything(
    client: Any, prefix: str
) -> None:
    stream = f"{prefix}:s"
    _fill(client, stream, 5)
    client.xgroup_create(stream, "g", id="0")
    assert trim_stream(client, stream, keep_from_ms=NONE_KEPT).trimmed == 0
    assert len(_ids(client, stream)) == 5


def test_the_bound_is_the_oldest_pending_entry(client: Any, prefix: str) -> None:
    stream = f"{prefix}:s"
    ids = _fill(client, stream, 10)
    client.xgroup_create(stream, "g", id="0")
    read = _read(client, stream, "g", "c", 6)
    client.xack(stream, "g", *read[:3], read[4])  # 4th (ids[3]) stays pending
    assert trim_stream(client, stream, keep_from_ms=NONE_KEPT).trimmed == 3
    assert _ids(client, stream) == ids[3:]  # the pending one and all after it


def test_a_second_group_that_reads_slowly_holds_the_bound(client: Any, prefix: str) -> None:
    stream = f"{prefix}:s"
    ids = _fill(client, stream, 10)
    client.xgroup_create(stream, "fast", id="0")
    client.xgroup_create(stream, "slow", id="0")
    _read_and_ack(client, stream, "fast", 10)
    _read_and_ack(client, stream, "slow", 2)
    trim_stream(client, stream, keep_from_ms=NONE_KEPT)
    assert _ids(client, stream) == ids[1:]  # slow's last delivered, and what it has not read
    _read_and_ack(client, stream, "slow", 3)
    trim_stream(client, stream, keep_from_ms=NONE_KEPT)
    assert _ids(client, stream) == ids[4:]
    _read_and_ack(client, stream, "slow", 10)
    trim_stream(client, stream, keep_from_ms=NONE_KEPT)
    assert _ids(client, stream) == ids[9:]  # all acknowledged: the last delivered one stays


def test_a_dead_consumers_pending_list_holds_the_bound(client: Any, prefix: str) -> None:
    stream = f"{prefix}:s"
    ids = _fill(client, stream, 10)
    client.xgroup_create(stream, "g", id="0")
    _read(client, stream, "g", "dead", 3)  # never acknowledged
    client.xack(stream, "g", *_read(client, stream, "g", "alive", 7))
    assert trim_stream(client, stream, keep_from_ms=NONE_KEPT).trimmed == 0
    assert _ids(client, stream) == ids
    # taken over and acknowledged by another consumer: now they may go
    claimed = client.xclaim(stream, "g", "alive", 0, ids[:3], justid=True)
    client.xack(stream, "g", *claimed)
    trim_stream(client, stream, keep_from_ms=NONE_KEPT)
    assert _ids(client, stream) == ids[9:]


def test_the_keep_floor_on_both_sides_of_its_edge(client: Any, prefix: str) -> None:
    stream = f"{prefix}:s"
    ids = _fill(client, stream, 10)
    client.xgroup_create(stream, "g", id="0")
    _read_and_ack(client, stream, "g", 10)
    trim_stream(client, stream, keep_from_ms=5000)  # 5000-0 and later stay
    assert _ids(client, stream) == ids[4:]
    trim_stream(client, stream, keep_from_ms=5001)
    assert _ids(client, stream) == ids[5:]


def test_unread_entries_stay_without_expiry_and_go_past_it(client: Any, prefix: str) -> None:
    stream = f"{prefix}:replies"
    ids = _fill(client, stream, 10, reply_ids=True)
    client.xgroup_create(stream, "g", id="0")
    _read_and_ack(client, stream, "g", 3)  # 1..3 read and acknowledged
    _read(client, stream, "g", "c", 2)  # 4, 5 pending
    assert trim_stream(client, stream, keep_from_ms=NONE_KEPT).expired == []
    assert _ids(client, stream) == ids[3:]  # from the oldest pending one
    result = trim_stream(client, stream, keep_from_ms=NONE_KEPT, expire_before_ms=7000)
    assert result.expired == [(ids[3], "r4"), (ids[4], "r5"), (ids[5], "r6")]
    assert _ids(client, stream) == ids[6:]  # 7000-0 is not before the expiry: it stays
    result = trim_stream(client, stream, keep_from_ms=NONE_KEPT, expire_before_ms=7001)
    assert result.expired == [(ids[6], "r7")]


def test_expiry_never_passes_the_keep_floor(client: Any, prefix: str) -> None:
    stream = f"{prefix}:replies"
    ids = _fill(client, stream, 10, reply_ids=True)
    result = trim_stream(client, stream, keep_from_ms=3000, expire_before_ms=8000)
    assert [eid for eid, _ in result.expired] == ids[:2]
    assert _ids(client, stream) == ids[2:]


def test_a_stream_without_groups_expires_by_age(client: Any, prefix: str) -> None:
    stream = f"{prefix}:replies"
    ids = _fill(client, stream, 5, reply_ids=True)
    result = trim_stream(client, stream, keep_from_ms=NONE_KEPT, expire_before_ms=3000)
    assert result.expired == [(ids[0], "r1"), (ids[1], "r2")]
    assert _ids(client, stream) == ids[2:]


def test_expired_entries_are_listed_in_pages(
    client: Any, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trimming, "EXPIRED_PER_CALL", 3)
    stream = f"{prefix}:replies"
    ids = _fill(client, stream, 10, reply_ids=True)
    client.xadd(stream, {"other": "x"}, id="10500-0")  # a stray entry without a reply id
    result = trim_stream(client, stream, keep_from_ms=NONE_KEPT, expire_before_ms=20_000)
    assert result.expired == [(eid, f"r{i}") for i, eid in enumerate(ids, 1)] + [("10500-0", "")]
    assert result.complete
    assert _ids(client, stream) == []
    monkeypatch.setattr(trimming, "MAX_CALLS_PER_TRIM", 2)
    _fill(client, f"{prefix}:more", 10, reply_ids=True)
    result = trim_stream(client, f"{prefix}:more", keep_from_ms=NONE_KEPT, expire_before_ms=20_000)
    assert len(result.expired) == 6
    assert not result.complete


def test_trim_by_age_on_both_sides_of_its_edge(client: Any, prefix: str) -> None:
    stream = f"{prefix}:dead"
    ids = _fill(client, stream, 5)
    assert trim_by_age(client, stream, 3000) == 2
    assert _ids(client, stream) == ids[2:]
    assert trim_by_age(client, stream, 3001) == 1
