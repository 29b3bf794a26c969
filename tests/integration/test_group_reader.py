"""GroupReader against a real redis-server: replay own pending, take over, dead letters."""

from __future__ import annotations

from typing import Any

import pytest

from broker_adapter.errors import RedisUnavailable
from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import connect, text
from broker_adapter.redis.reader import GroupReader, ReaderConfig
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration


def _reader(server: RedisServer, prefix: str, consumer: str, **cfg: int) -> tuple[GroupReader, Any]:
    keys = Keys(prefix)
    client = connect(server.url)
    reader = GroupReader(
        client,
        keys.inbound(),
        "g",
        consumer,
        keys.inbound_dead(),
        ReaderConfig(block_ms=50, **cfg),
    )
    return reader, client


def test_group_reader_replays_own_pending_before_new(
    redis_server: RedisServer, prefix: str
) -> None:
    reader, client = _reader(redis_server, prefix, "c1")
    reader.ensure_group()
    for i in range(3):
        client.xadd(reader.stream, {"n": str(i)})
    assert reader.read() == []  # first read: own pending list is empty, switch to '>'
    first = reader.read()
    assert [e.fields for e in first] == [{b"n": str(i).encode()} for i in range(3)]
    # a "restart" with the same consumer name: the unacknowledged entries come back first
    again, _ = _reader(redis_server, prefix, "c1")
    replay = again.read()
    assert [e.entry_id for e in replay] == [e.entry_id for e in first]
    assert all(e.deliveries == 2 for e in replay)
    assert again.ack([e.entry_id for e in replay]) == 3
    assert again.ack([e.entry_id for e in replay]) == 0  # a repeated XACK is not an error
    assert again.pending() == {}


def test_group_reader_group_created_from_zero_sees_earlier_entries(
    redis_server: RedisServer, prefix: str
) -> None:
    reader, client = _reader(redis_server, prefix, "c1")
    client.xadd(reader.stream, {"early": "1"})
    reader.read()
    assert [e.fields for e in reader.read()] == [{b"early": b"1"}]


def test_group_reader_takes_over_idle_entries_and_dead_letters_deleted(
    redis_server: RedisServer, prefix: str
) -> None:
    dead_reader, client = _reader(redis_server, prefix, "dead")
    dead_reader.ensure_group()
    ids = [client.xadd(dead_reader.stream, {"n": str(i)}).decode() for i in range(4)]
    dead_reader.read()
    assert len(dead_reader.read()) == 4
    for eid in ids:  # age them past min-idle without waiting
        client.xclaim(dead_reader.stream, "g", "dead", 0, [eid], idle=3_600_000, justid=True)
    client.xdel(dead_reader.stream, ids[1])  # deleted while pending (after ageing: XCLAIM
    # of a deleted id would drop it from the pending list itself)
    heir, _ = _reader(redis_server, prefix, "heir", claim_min_idle_ms=60_000, count=2)
    taken = []
    while True:
        taken += heir.take_over()
        if heir.scan_complete:
            break
    assert sorted(e.entry_id for e in taken) == sorted([ids[0], ids[2], ids[3]])
    dead = client.xrange(heir.dead_stream)
    assert [f[b"dl.reason"] for _, f in dead] == [b"payload_deleted"]
    assert dead[0][1][b"dl.entry_id"] == ids[1].encode()


def test_group_reader_dead_letters_past_delivery_limit(
    redis_server: RedisServer, prefix: str
) -> None:
    reader, client = _reader(redis_server, prefix, "c1", max_deliveries=3)
    reader.ensure_group()
    eid = client.xadd(reader.stream, {"poison": "1"}).decode()
    reader.read()
    reader.read()
    client.xclaim(reader.stream, "g", "c1", 0, [eid], retrycount=5, justid=True)
    fresh, _ = _reader(redis_server, prefix, "c1", max_deliveries=3)
    assert fresh.read() == []
    assert fresh.pending() == {}
    (dead,) = client.xrange(fresh.dead_stream)
    assert dead[1][b"dl.reason"] == b"delivery_limit"
    assert dead[1][b"orig.poison"] == b"1"


def test_group_reader_recreates_missing_group_after_wipe(
    fresh_redis: RedisServer, prefix: str
) -> None:
    reader, client = _reader(fresh_redis, prefix, "c1")
    reader.ensure_group()
    client.xadd(reader.stream, {"n": "1"})
    reader.read()
    assert len(reader.read()) == 1
    fresh_redis.restart(wipe=True)
    client.xadd(reader.stream, {"n": "2"})  # a publish after the wipe: stream exists, no group
    assert reader.read() == []  # NOGROUP: recreated, alarm logged
    assert reader.stats.group_recreated == 1
    reader.read()
    assert [e.fields for e in reader.read()] == [{b"n": b"2"}]


def test_group_reader_peeking_ack_reads_the_next_batch_in_the_same_trip(
    redis_server: RedisServer, prefix: str
) -> None:
    reader, client = _reader(redis_server, prefix, "c1", count=2)
    reader.ensure_group()
    for i in range(5):
        client.xadd(reader.stream, {"n": str(i)})
    assert reader.read() == []  # own pending list empty: from now on new entries
    first = reader.read()
    assert reader.ack([e.entry_id for e in first], peek=True) == 2
    assert reader.has_ahead
    rows = client.xpending_range(reader.stream, "g", min="-", max="+", count=10)
    ahead = reader.read()  # what the ack read, without a round trip of its own
    assert [e.fields for e in ahead] == [{b"n": b"2"}, {b"n": b"3"}]
    assert {text(r["message_id"]) for r in rows} == {e.entry_id for e in ahead}
    assert not reader.has_ahead
    # an error drops what was read ahead (it is in the pending list, replayed first)
    assert reader.ack([ahead[0].entry_id], peek=True) == 1
    assert reader.has_ahead
    reader.reset()
    assert not reader.has_ahead
    replay = reader.read()  # own pending: the unhandled one, and the one dropped from memory
    assert [e.fields for e in replay] == [{b"n": b"3"}, {b"n": b"4"}]
    # while replaying, a peeking ack only acknowledges
    assert reader.ack([e.entry_id for e in replay], peek=True) == 2
    assert not reader.has_ahead
    assert reader.ack([], peek=True) == 0


def _fill(reader: GroupReader, client: Any, n: int) -> None:
    reader.ensure_group()
    for i in range(n):
        client.xadd(reader.stream, {"n": str(i)})
    assert reader.read() == []  # own pending list empty: from now on new entries


def _numbers(entries: list[Any]) -> list[int]:
    return [int(e.fields[b"n"]) for e in entries]


def _prefetching(
    server: RedisServer, prefix: str, n: int, count: int = 2
) -> tuple[GroupReader, Any, list[Any]]:
    """A reader (batches of ``count``) over ``n`` entries that read its first batch and sent
    the read of the next (``prefetch``: a whole batch came); returns it, its client and that
    first batch."""
    reader, client = _reader(server, prefix, "c1", count=count)
    _fill(reader, client, n)
    first = reader.read()
    assert reader.prefetch()
    return reader, client, first


def test_group_reader_prefetch_sends_the_next_read_and_the_ack_takes_its_reply(
    redis_server: RedisServer, prefix: str
) -> None:
    reader, client, first = _prefetching(redis_server, prefix, 7, count=3)
    assert _numbers(first) == [0, 1, 2]
    assert reader.has_ahead
    assert not reader.prefetch()  # one read in flight at most
    # the read was sent before this batch was acknowledged: Redis delivered it already
    assert len(client.xpending_range(reader.stream, "g", min="-", max="+", count=10)) == 6
    assert reader.ack([e.entry_id for e in first], peek=True) == 3  # takes the reply too
    second = reader.read()
    assert _numbers(second) == [3, 4, 5]
    assert reader.prefetch()
    assert reader.ack([e.entry_id for e in second]) == 3  # peek or not: the reply is taken
    third = reader.read()
    assert _numbers(third) == [6]
    assert not reader.prefetch()  # a short batch: nothing is likely waiting
    assert reader.ack([third[0].entry_id], peek=True) == 1
    assert not reader.has_ahead
    assert reader.pending() == {}
    assert (reader.stats.read, reader.stats.acked) == (7, 7)


def test_group_reader_prefetch_is_not_sent_while_replaying_or_after_a_short_batch(
    redis_server: RedisServer, prefix: str
) -> None:
    reader, client = _reader(redis_server, prefix, "c1", count=2)
    reader.ensure_group()
    client.xadd(reader.stream, {"n": "0"})
    client.xadd(reader.stream, {"n": "1"})
    assert not reader.prefetch()  # nothing read yet
    assert reader.read() == []
    assert len(reader.read()) == 2
    reader.reset()  # an error: the next reads replay the pending list
    assert not reader.prefetch()
    assert _numbers(reader.read()) == [0, 1]  # replayed, a full batch, still replaying
    assert not reader.prefetch()


def test_group_reader_prefetched_entries_come_back_after_a_reset(
    redis_server: RedisServer, prefix: str
) -> None:
    reader, _client, first = _prefetching(redis_server, prefix, 4)
    reader.reset()  # e.g. the accept transaction failed: the reply in flight is dropped
    assert not reader.has_ahead
    replay = reader.read()
    assert _numbers(replay) == [0, 1]
    assert reader.ack([e.entry_id for e in replay]) == 2
    replay = reader.read()  # the prefetched two are in the pending list too
    assert _numbers(replay) == [2, 3]
    assert all(e.deliveries == 2 for e in replay)
    assert reader.ack([e.entry_id for e in replay]) == 2
    assert reader.read() == []
    assert reader.pending() == {}
    assert _numbers(first) == [0, 1]


def test_group_reader_read_takes_a_prefetch_that_no_ack_took(
    redis_server: RedisServer, prefix: str
) -> None:
    """A batch that is all dead letters has nothing to acknowledge: the next read takes
    the prefetched reply."""
    reader, client, first = _prefetching(redis_server, prefix, 3)
    for entry in first:
        reader.dead_letter(entry, "bad", "for the test")
    assert reader.has_ahead
    assert _numbers(reader.read()) == [2]
    assert not reader.has_ahead
    assert [f[b"dl.reason"] for _, f in client.xrange(reader.dead_stream)] == [b"bad", b"bad"]


def test_group_reader_prefetch_with_the_group_gone_recreates_it(
    fresh_redis: RedisServer, prefix: str
) -> None:
    reader, client = _reader(fresh_redis, prefix, "c1", count=2)
    _fill(reader, client, 2)
    first = reader.read()
    client.xgroup_destroy(reader.stream, "g")
    assert reader.prefetch()  # the NOGROUP error comes back with the reply
    assert reader.ack([e.entry_id for e in first], peek=True) == 0
    assert reader.stats.group_recreated == 1
    assert reader.read() == []  # recreated from 0: the replay of an empty pending list
    assert _numbers(reader.read()) == [0, 1]


def test_group_reader_connection_killed_with_a_prefetch_in_flight(
    redis_server: RedisServer, prefix: str
) -> None:
    reader, _client, first = _prefetching(redis_server, prefix, 4)
    admin = redis_server.client()
    mine = [c for c in admin.client_list() if c["cmd"] == "xreadgroup"]
    for c in mine:
        admin.client_kill_filter(_id=c["id"])
    with pytest.raises(RedisUnavailable):
        reader.ack([e.entry_id for e in first], peek=True)
    assert not reader.has_ahead
    seen: list[int] = []
    while batch := reader.read():  # the replay of the pending list, until it is empty
        seen += _numbers(batch)
        reader.ack([e.entry_id for e in batch])
    assert seen == [0, 1, 2, 3]  # nothing lost: the replay brings the prefetched two too
    assert reader.pending() == {}
