"""Ingress limits on a real redis-server: a flood from one principal is refused with a
reason (never dropped) and does not starve another principal's request; the quota of open
tasks on both sides of its edge."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from broker_adapter.clock import FakeClock
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect
from broker_adapter.stages.ingest.config import IngestConfig
from broker_adapter.stages.ingest.ingest import Ingestor
from broker_adapter.store import TaskStore, open_database
from tests.support.ingest_script import drain, envelope, pending_total, task_counts
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

SECRETS = {p: f"{p} secret of this test, 32 bytes or more" for p in ("alice", "mallory")}
KEYRING = Keyring({p: {f"{p}-1": s} for p, s in SECRETS.items()})
FLOOD = 5_000
#: What the flood test asserts of alice's wait (measured: 1.2 s on 2 shared cores, the
#: 5,000 HMAC checks and dead-letter copies ahead of her entry).
ALICE_BOUND_S = 20.0


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    c = connect(redis_server.url)
    yield c
    c.close()


@pytest.fixture
def tasks(tmp_path: Path, clock: FakeClock) -> Iterator[TaskStore]:
    db = open_database(tmp_path / "inbox.db")
    yield TaskStore(db, clock)
    db.close()


def publish(client: redis.Redis, keys: Keys, principal: str, ids: list[str]) -> None:
    """Sign and XADD one envelope per id to the shared stream, pipelined."""
    pipe = client.pipeline(transaction=False)
    for message_id in ids:
        fields = KEYRING.sign(envelope(message_id, sender=principal))
        pipe.xadd(keys.inbound(), cast(Any, fields))
    pipe.execute()


def dead_reasons(client: redis.Redis, stream: str) -> dict[tuple[str, str], int]:
    """Dead letters per (reason, principal)."""
    out: dict[tuple[str, str], int] = {}
    for _, f in cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(stream)):
        key = (f[b"dl.reason"].decode(), f.get(b"dl.principal", b"").decode())
        out[key] = out.get(key, 0) + 1
    return out


def test_a_flood_is_dead_lettered_and_another_principal_is_stored_within_a_bound(
    client: redis.Redis, prefix: str, tasks: TaskStore, clock: FakeClock
) -> None:
    keys = Keys(prefix)
    publish(client, keys, "mallory", [f"m{i}" for i in range(FLOOD)])
    publish(client, keys, "alice", ["a0"])
    config = IngestConfig(prefix=prefix, consumer="ingest-0", rate_limit=10.0, rate_burst=50)
    quiet = logging.getLogger("test.limits.flood")
    quiet.setLevel(logging.ERROR)
    ingestor = Ingestor(config, client, tasks, KEYRING, clock=clock, logger=quiet)

    started = time.monotonic()  # the clock of the bucket is frozen: only the burst passes
    while tasks.find("alice", "a0") is None:
        assert time.monotonic() - started < ALICE_BOUND_S, "alice starved behind the flood"
        ingestor.step()
    waited = time.monotonic() - started
    drain(ingestor, client)

    print(f"alice stored {waited:.2f}s after the ingest met a flood of {FLOOD}")
    counts = task_counts(tasks)
    assert counts[("alice", "a0")] == 1
    assert sum(n for (p, _), n in counts.items() if p == "mallory") == 50
    assert all(counts.get(("mallory", f"m{i}")) == 1 for i in range(50))  # the first ones
    refused = FLOOD - 50
    assert dead_reasons(client, keys.inbound_dead()) == {("rate_limited", "mallory"): refused}
    assert ingestor.stats.dead_lettered == {"rate_limited": refused}
    assert ingestor.stats.accepted == 51
    assert pending_total(client, keys.inbound()) == 0  # every entry answered, none dropped
    # the dead letter keeps the original, so the sender's resend or an operator's replay can
    # still bring it in once the bucket has refilled
    newest = client.xrevrange(keys.inbound_dead(), count=1)
    _, last = cast(list[tuple[bytes, dict[bytes, bytes]]], newest)[0]
    assert last[b"orig.env"]
    assert last[b"orig.sig"]
    assert last[b"dl.field"] == b""


def test_a_refilled_bucket_admits_the_resend(
    client: redis.Redis, prefix: str, tasks: TaskStore, clock: FakeClock
) -> None:
    keys = Keys(prefix)
    config = IngestConfig(prefix=prefix, consumer="ingest-0", rate_limit=2.0, rate_burst=2)
    ingestor = Ingestor(config, client, tasks, KEYRING, clock=clock)
    publish(client, keys, "alice", ["a0", "a1", "a2"])
    drain(ingestor, client)
    assert set(task_counts(tasks)) == {("alice", "a0"), ("alice", "a1")}
    clock.advance(0.5)  # one token back
    publish(client, keys, "alice", ["a2", "a3"])  # the refused one resent, and one more
    drain(ingestor, client)
    assert set(task_counts(tasks)) == {("alice", "a0"), ("alice", "a1"), ("alice", "a2")}
    assert dead_reasons(client, keys.inbound_dead()) == {("rate_limited", "alice"): 2}


def test_open_task_quota_on_both_sides_of_its_edge(
    client: redis.Redis, prefix: str, tasks: TaskStore, clock: FakeClock
) -> None:
    keys = Keys(prefix)
    config = IngestConfig(prefix=prefix, consumer="ingest-0", max_open_tasks=3)
    ingestor = Ingestor(config, client, tasks, KEYRING, clock=clock)
    publish(client, keys, "alice", ["a0", "a1"])
    drain(ingestor, client)
    publish(client, keys, "alice", ["a2", "a3"])  # 2 open: one more fits, the next does not
    publish(client, keys, "mallory", ["m0"])
    drain(ingestor, client)
    assert tasks.open_counts() == {"alice": 3, "mallory": 1}
    assert dead_reasons(client, keys.inbound_dead()) == {("quota_exceeded", "alice"): 1}

    claimed = tasks.claim("w1", 4)  # running is still open; one of alice's finishes
    done = next(c for c in claimed if c.principal == "alice")
    tasks.finish(done.task_id, done.owner, done.fence, {})
    publish(client, keys, "alice", ["a3", "a4"])
    drain(ingestor, client)
    assert tasks.open_counts() == {"alice": 3, "mallory": 1}
    assert ("alice", "a3") in task_counts(tasks)
    assert ("alice", "a4") not in task_counts(tasks)
    assert dead_reasons(client, keys.inbound_dead()) == {("quota_exceeded", "alice"): 2}
    assert ingestor.stats.dead_lettered == {"quota_exceeded": 2}


def test_re_adds_of_a_stored_request_spend_no_rate_budget(
    client: redis.Redis, prefix: str, tasks: TaskStore, clock: FakeClock
) -> None:
    """Anybody who may write the stream can add a captured signed entry again without any
    key: the copies are duplicates of a stored request and must not spend its principal's
    tokens, so the principal's own new requests still get the whole burst (and no more)."""
    keys = Keys(prefix)
    config = IngestConfig(
        prefix=prefix, consumer="ingest-0", rate_limit=0.001, rate_burst=10, block_ms=20
    )
    ingestor = Ingestor(config, client, tasks, KEYRING, clock=clock)
    publish(client, keys, "alice", ["captured"])
    drain(ingestor, client)  # stored: one token spent, 9 left
    ((_, captured),) = cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(keys.inbound()))
    pipe = client.pipeline(transaction=False)
    for _ in range(30):  # keyless re-adds, in the same batches as alice's new requests
        pipe.xadd(keys.inbound(), cast(Any, captured))
    pipe.execute()
    publish(client, keys, "alice", [f"new{i}" for i in range(10)])  # one more than is left
    drain(ingestor, client)
    counts = task_counts(tasks)
    assert counts == {("alice", "captured"): 1} | {("alice", f"new{i}"): 1 for i in range(9)}
    assert dead_reasons(client, keys.inbound_dead()) == {("rate_limited", "alice"): 1}
    assert ingestor.stats.duplicates == 30
