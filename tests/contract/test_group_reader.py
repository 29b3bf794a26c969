"""GroupReader's contract, on a redis-server and on fakeredis: replay own pending first, take
over idle entries, dead letters, the peeking acknowledgement and the prefetched read."""

from __future__ import annotations

from broker_adapter.redis.client import text
from tests.support.backends import Backend
from tests.support.group_reader import fill, make_reader, numbers, prefetching


def test_group_reader_replays_own_pending_before_new(backend: Backend, prefix: str) -> None:
    reader, client = make_reader(backend, prefix, "c1")
    reader.ensure_group()
    for i in range(3):
        client.xadd(reader.stream, {"n": str(i)})
    assert reader.read() == []  # first read: own pending list is empty, switch to '>'
    first = reader.read()
    assert [e.fields for e in first] == [{b"n": str(i).encode()} for i in range(3)]
    # a "restart" with the same consumer name: the unacknowledged entries come back first
    again, _ = make_reader(backend, prefix, "c1")
    replay = again.read()
    assert [e.entry_id for e in replay] == [e.entry_id for e in first]
    assert all(e.deliveries == 2 for e in replay)
    assert again.ack([e.entry_id for e in replay]) == 3
    assert again.ack([e.entry_id for e in replay]) == 0  # a repeated XACK is not an error
    assert again.pending() == {}


def test_group_reader_group_created_from_zero_sees_earlier_entries(
    backend: Backend, prefix: str
) -> None:
    reader, client = make_reader(backend, prefix, "c1")
    client.xadd(reader.stream, {"early": "1"})
    reader.read()
    assert [e.fields for e in reader.read()] == [{b"early": b"1"}]


def test_group_reader_takes_over_idle_entries_and_dead_letters_deleted(
    backend: Backend, prefix: str
) -> None:
    dead_reader, client = make_reader(backend, prefix, "dead")
    dead_reader.ensure_group()
    ids = [client.xadd(dead_reader.stream, {"n": str(i)}).decode() for i in range(4)]
    dead_reader.read()
    assert len(dead_reader.read()) == 4
    for eid in ids:  # age them past min-idle without waiting
        client.xclaim(dead_reader.stream, "g", "dead", 0, [eid], idle=3_600_000, justid=True)
    client.xdel(dead_reader.stream, ids[1])  # deleted while pending (after ageing: XCLAIM
    # of a deleted id would drop it from the pending list itself)
    heir, _ = make_reader(backend, prefix, "heir", claim_min_idle_ms=60_000, count=2)
    taken = []
    while True:
        taken += heir.take_over()
        if heir.scan_complete:
            break
    assert sorted(e.entry_id for e in taken) == sorted([ids[0], ids[2], ids[3]])
    dead = client.xrange(heir.dead_stream)
    assert [f[b"dl.reason"] for _, f in dead] == [b"payload_deleted"]
    assert dead[0][1][b"dl.entry_id"] == ids[1].encode()


def test_group_reader_dead_letters_past_delivery_limit(backend: Backend, prefix: str) -> None:
    reader, client = make_reader(backend, prefix, "c1", max_deliveries=3)
    reader.ensure_group()
    eid = client.xadd(reader.stream, {"poison": "1"}).decode()
    reader.read()
    reader.read()
    client.xclaim(reader.stream, "g", "c1", 0, [eid], retrycount=5, justid=True)
    fresh, _ = make_reader(backend, prefix, "c1", max_deliveries=3)
    assert fresh.read() == []
    assert fresh.pending() == {}
    (dead,) = client.xrange(fresh.dead_stream)
    assert dead[1][b"dl.reason"] == b"delivery_limit"
    assert dead[1][b"orig.poison"] == b"1"


def test_group_reader_peeking_ack_reads_the_next_batch_in_the_same_trip(
    backend: Backend, prefix: str
) -> None:
    reader, client = make_reader(backend, prefix, "c1", count=2)
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


def test_group_reader_prefetch_sends_the_next_read_and_the_ack_takes_its_reply(
    backend: Backend, prefix: str
) -> None:
    reader, client, first = prefetching(backend, prefix, 7, count=3)
    assert numbers(first) == [0, 1, 2]
    assert reader.has_ahead
    assert not reader.prefetch()  # one read in flight at most
    # the read was sent before this batch was acknowledged: Redis delivered it already
    assert len(client.xpending_range(reader.stream, "g", min="-", max="+", count=10)) == 6
    assert reader.ack([e.entry_id for e in first], peek=True) == 3  # takes the reply too
    second = reader.read()
    assert numbers(second) == [3, 4, 5]
    assert reader.prefetch()
    assert reader.ack([e.entry_id for e in second]) == 3  # peek or not: the reply is taken
    third = reader.read()
    assert numbers(third) == [6]
    assert not reader.prefetch()  # a short batch: nothing is likely waiting
    assert reader.ack([third[0].entry_id], peek=True) == 1
    assert not reader.has_ahead
    assert reader.pending() == {}
    assert (reader.stats.read, reader.stats.acked) == (7, 7)


def test_group_reader_prefetch_is_not_sent_while_replaying_or_after_a_short_batch(
    backend: Backend, prefix: str
) -> None:
    reader, client = make_reader(backend, prefix, "c1", count=2)
    reader.ensure_group()
    client.xadd(reader.stream, {"n": "0"})
    client.xadd(reader.stream, {"n": "1"})
    assert not reader.prefetch()  # nothing read yet
    assert reader.read() == []
    assert len(reader.read()) == 2
    reader.reset()  # an error: the next reads replay the pending list
    assert not reader.prefetch()
    assert numbers(reader.read()) == [0, 1]  # replayed, a full batch, still replaying
    assert not reader.prefetch()


def test_group_reader_prefetched_entries_come_back_after_a_reset(
    backend: Backend, prefix: str
) -> None:
    reader, _client, first = prefetching(backend, prefix, 4)
    reader.reset()  # e.g. the accept transaction failed: the reply in flight is dropped
    assert not reader.has_ahead
    replay = reader.read()
    assert numbers(replay) == [0, 1]
    assert reader.ack([e.entry_id for e in replay]) == 2
    replay = reader.read()  # the prefetched two are in the pending list too
    assert numbers(replay) == [2, 3]
    assert all(e.deliveries == 2 for e in replay)
    assert reader.ack([e.entry_id for e in replay]) == 2
    assert reader.read() == []
    assert reader.pending() == {}
    assert numbers(first) == [0, 1]


def test_group_reader_read_takes_a_prefetch_that_no_ack_took(backend: Backend, prefix: str) -> None:
    """A batch that is all dead letters has nothing to acknowledge: the next read takes
    the prefetched reply."""
    reader, client, first = prefetching(backend, prefix, 3)
    for entry in first:
        reader.dead_letter(entry, "bad", "for the test")
    assert reader.has_ahead
    assert numbers(reader.read()) == [2]
    assert not reader.has_ahead
    assert [f[b"dl.reason"] for _, f in client.xrange(reader.dead_stream)] == [b"bad", b"bad"]


def test_group_reader_prefetch_with_the_group_gone_recreates_it(
    backend: Backend, prefix: str
) -> None:
    reader, client = make_reader(backend, prefix, "c1", count=2)
    fill(reader, client, 2)
    first = reader.read()
    client.xgroup_destroy(reader.stream, "g")
    assert reader.prefetch()  # the NOGROUP error comes back with the reply
    assert reader.ack([e.entry_id for e in first], peek=True) == 0
    assert reader.stats.group_recreated == 1
    assert reader.read() == []  # recreated from 0: the replay of an empty pending list
    assert numbers(reader.read()) == [0, 1]
