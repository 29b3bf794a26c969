"""GroupReader's faults against a real redis-server: a wiped server, a killed connection.
The reader's contract (tests/contract/test_group_reader.py) runs on fakeredis too."""

from __future__ import annotations

import pytest

from broker_adapter.errors import RedisUnavailable
from tests.support.backends import real_backend
from tests.support.group_reader import make_reader, numbers, prefetching
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration


def test_group_reader_recreates_missing_group_after_wipe(
    fresh_redis: RedisServer, prefix: str
) -> None:
    reader, client = make_reader(real_backend(fresh_redis), prefix, "c1")
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


def test_group_reader_connection_killed_with_a_prefetch_in_flight(
    redis_server: RedisServer, prefix: str
) -> None:
    reader, _client, first = prefetching(real_backend(redis_server), prefix, 4)
    admin = redis_server.client()
    mine = [c for c in admin.client_list() if c["cmd"] in ("xreadgroup", "fcall")]
    for c in mine:
        admin.client_kill_filter(_id=c["id"])
    with pytest.raises(RedisUnavailable):
        reader.ack([e.entry_id for e in first], peek=True)
    assert not reader.has_ahead
    seen: list[int] = []
    while batch := reader.read():  # the replay of the pending list, until it is empty
        seen += numbers(batch)
        reader.ack([e.entry_id for e in batch])
    assert seen == [0, 1, 2, 3]  # nothing lost: the replay brings the prefetched two too
    assert reader.pending() == {}
