"""The ingest's periodic trim against a real redis-server: every group on the inbound
stream bounds it (a second group that reads slowly), acknowledged entries stay for the keep
window, dead letters go by age. Time passes on a ``FakeClock``."""

from __future__ import annotations

import time
from typing import Any

import pytest

from broker_adapter.client.publisher import Publisher
from broker_adapter.clock import FakeClock
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect, text
from broker_adapter.stages.ingest.config import IngestConfig
from broker_adapter.stages.ingest.ingest import Ingestor
from broker_adapter.store import TaskStore
from tests.support.ingest_script import drain, envelope, real_deadline, xadd_signed
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

# A clock a day behind the server's (the trims take the earlier of the two), exact in ms.
START = float(int(time.time()) - 86_400)
MS = int(START * 1000)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


def _ingestor(
    server: RedisServer,
    prefix: str,
    tasks: TaskStore,
    keyring: Keyring,
    clock: FakeClock,
    **cfg: float,
) -> tuple[Ingestor, Any]:
    client = connect(server.url)
    config = IngestConfig(prefix=prefix, consumer="ingest-t", block_ms=20, **cfg)
    return Ingestor(config, client, tasks, keyring, clock=clock), client


def _ids(client: Any, stream: str) -> list[str]:
    return [text(eid) for eid, _ in client.xrange(stream)]


def test_a_second_group_that_reads_slowly_bounds_the_ingests_trim(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    clock.set(time.time() + 3600)  # ahead of the server: the server's clock counts
    ingestor, client = _ingestor(redis_server, prefix, tasks, keyring, clock, trim_keep_s=0)
    keys = Keys(prefix)
    stream = keys.inbound()
    ids = [
        xadd_signed(client, keys, keyring, envelope(f"m{i}", deadline=real_deadline(7200)))
        for i in range(10)
    ]
    client.xgroup_create(stream, "audit", id="0")
    drain(ingestor, client)
    assert ingestor.trim() == 0  # audit has read nothing: everything stays
    assert _ids(client, stream) == ids
    audit = client.xreadgroup("audit", "slow", {stream: ">"}, count=4)
    client.xack(stream, "audit", *[eid for eid, _ in audit[0][1]])
    assert ingestor.trim() == 3
    assert _ids(client, stream) == ids[3:]  # audit's last delivered one, and after
    client.xgroup_destroy(stream, "audit")
    ingestor.trim()
    assert _ids(client, stream) == ids[9:]  # ba-ingest read all: its last delivered stays
    assert ingestor.stats.trimmed == 9


def test_trim_runs_every_trim_every_s(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    clock.set(time.time() + 3600)  # ahead of the server: the server's clock counts
    ingestor, client = _ingestor(
        redis_server, prefix, tasks, keyring, clock, trim_every_s=30, trim_keep_s=0
    )
    publisher = Publisher(client, Keys(prefix), "alice", keyring)
    for i in range(5):
        publisher.publish(envelope(f"m{i}", deadline=real_deadline(7200)))
    stream = Keys(prefix).inbound()
    drain(ingestor, client)
    clock.advance(29.9)
    ingestor.tick()
    assert client.xlen(stream) == 5  # not due yet
    clock.advance(0.1)
    ingestor.tick()
    assert client.xlen(stream) == 1


def test_acknowledged_entries_stay_for_the_keep_window(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    # keep = min(trim_keep_s, retention_s): entries from START - 60 s on stay
    ingestor, client = _ingestor(
        redis_server, prefix, tasks, keyring, clock, trim_keep_s=300, retention_s=60
    )
    stream = Keys(prefix).inbound()
    edge = MS - 60_000
    for ms in (edge - 2, edge - 1, edge, edge + 1):
        client.xadd(stream, {"junk": "not an envelope"}, id=f"{ms}-0")
    drain(ingestor, client)  # each one dead-lettered (and acknowledged)
    assert client.xlen(Keys(prefix).inbound_dead()) == 4
    ingestor.trim()
    assert _ids(client, stream) == [f"{edge}-0", f"{edge + 1}-0"]


def test_dead_letters_go_by_age(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    ingestor, client = _ingestor(redis_server, prefix, tasks, keyring, clock, retention_s=100)
    dead = Keys(prefix).inbound_dead()
    cutoff = MS - 100_000
    for ms in (cutoff - 1, cutoff, cutoff + 1):
        client.xadd(dead, {"dl.reason": "bad_json"}, id=f"{ms}-0")
    client.xgroup_create(Keys(prefix).inbound(), "ba-ingest", id="0", mkstream=True)
    assert ingestor.trim() == 1
    assert _ids(client, dead) == [f"{cutoff}-0", f"{cutoff + 1}-0"]
    clock.advance(0.0015)  # one millisecond on (and a half, against float rounding)
    assert ingestor.trim() == 1
    assert ingestor.stats.dead_letters_trimmed == 2


def test_a_refused_trim_is_an_alarm_not_a_stop(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    ingestor, client = _ingestor(redis_server, prefix, tasks, keyring, clock)
    client.set(Keys(prefix).inbound(), "not a stream")
    assert ingestor.trim() == 0
    assert ingestor.stats.trim_failures == 1
