"""Ingest against a real redis-server: once into the inbox, bad input dead-lettered with its
reason, takeover of a dead consumer, and faults (connection killed, CLIENT PAUSE, server
killed and restarted from its AOF) that neither lose nor double a request."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import pydantic
import pytest
import redis

from broker_adapter.client.publisher import AsyncPublisher, Publisher
from broker_adapter.clock import FakeClock
from broker_adapter.errors import AuthError, ConfigError, RedisUnavailable
from broker_adapter.protocol.keys import INGEST_GROUP, Keys
from broker_adapter.protocol.signing import Keyring, signature
from broker_adapter.redis.client import connect, connect_async, text
from broker_adapter.stages.ingest.config import IngestConfig
from broker_adapter.stages.ingest.ingest import Ingestor
from broker_adapter.store import AcceptItem, AcceptResult, OutboxStore, TaskStore
from tests.support.ingest_script import (
    DEADLINE,
    KEYRING,
    age_pending,
    drain,
    drained,
    envelope,
    pending_total,
    task_counts,
    xadd_signed,
)
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

ALICE = ("alice-2026", KEYRING["alice"]["alice-2026"].encode())
BOB = ("bob-1", KEYRING["bob"]["bob-1"].encode())


def _alice_published(
    redis_server: RedisServer, prefix: str, keyring: Keyring, tag: str, n: int
) -> tuple[redis.Redis, Keys, Publisher]:
    """A client, the keys and alice's publisher, after alice added ``{tag}0`` to
    ``{tag}{n-1}`` to the stream (directly: the tests read the stream before any ingest)."""
    client = connect(redis_server.url)
    keys = Keys(prefix)
    pub = Publisher(client, keys, "alice", keyring)
    for i in range(n):
        xadd_signed(client, keys, keyring, envelope(f"{tag}{i}"))
    return client, keys, pub


def _ingestor(
    client: redis.Redis,
    prefix: str,
    tasks: TaskStore,
    keyring: Keyring,
    clock: FakeClock,
    **cfg: Any,
) -> Ingestor:
    settings: dict[str, Any] = {"prefix": prefix, "consumer": "ingest-t-0", "block_ms": 20}
    settings.update(cfg)
    return Ingestor(IngestConfig(**settings), client, tasks, keyring, clock=clock)


def _canon(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _signed(env: bytes, key: tuple[str, bytes] = ALICE) -> dict[bytes, bytes]:
    kid, secret = key
    return {
        b"v": b"1",
        b"env": env,
        b"kid": kid.encode(),
        b"sig": signature(secret, kid, env).encode(),
    }


def _raw_env(**over: Any) -> dict[str, Any]:
    env: dict[str, Any] = {
        "message_id": "x",
        "sender": "alice",
        "payload": {"x": 1},
        "deadline": DEADLINE,
    }
    for k, v in over.items():
        if v is _DROP:
            env.pop(k)
        else:
            env[k] = v
    return env


_DROP = object()


class CountingStore(TaskStore):
    """A TaskStore that counts accept transactions and can run a hook after each commit."""

    def __init__(self, inner: TaskStore) -> None:
        super().__init__(inner.db, inner.clock, inner.policy)
        self.calls = 0
        self.after_commit: Callable[[int], object] | None = None

    def accept(self, items: Sequence[AcceptItem]) -> list[AcceptResult]:
        results = super().accept(items)
        self.calls += 1
        if self.after_commit is not None:
            self.after_commit(self.calls)
        return results


def _wait_for(cond: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)  # polling a condition with an explicit timeout


def _xrange(client: redis.Redis, stream: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    return cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(stream))


def _xack_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_xack", {}).get("calls", 0))


# -- the happy path --------------------------------------------------------------------------


def test_ingest_stores_each_request_once_with_one_xack_per_batch(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    client = connect(redis_server.url)
    keys = Keys(prefix)
    alice = Publisher(client, keys, "alice", keyring)
    bob = Publisher(client, keys, "bob", keyring)
    for i in range(30):
        alice.publish(envelope(f"m{i}"))
    for i in range(5):
        alice.publish(envelope(f"m{i}"))  # resends: same id, same content
        bob.publish(envelope(f"m{i}", sender="bob"))  # same id, other principal
    store = CountingStore(tasks)
    ingestor = _ingestor(client, prefix, store, keyring, clock, count=16)
    before = _xack_calls(client)
    drain(ingestor, client)

    expected = {("alice", f"m{i}"): 1 for i in range(30)} | {("bob", f"m{i}"): 1 for i in range(5)}
    assert task_counts(tasks) == expected
    assert (ingestor.stats.accepted, ingestor.stats.duplicates) == (35, 5)
    assert ingestor.stats.acked == 40
    assert store.calls == 3  # 40 entries in batches of 16: one accept transaction each
    assert _xack_calls(client) - before == 3  # ... and one XACK each
    assert pending_total(client, keys.inbound()) == 0
    assert client.xlen(keys.inbound_dead()) == 0


def test_ingest_duplicate_storm_adds_no_tasks(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    client, keys, _pub = _alice_published(redis_server, prefix, keyring, "s", 20)
    ingestor = _ingestor(client, prefix, tasks, keyring, clock, count=7)
    drain(ingestor, client)
    first = task_counts(tasks)
    for _ in range(3):  # rewind the group: every entry is delivered again
        client.xgroup_setid(keys.inbound(), INGEST_GROUP, "0")
        ingestor.step()  # pending replay is empty; switches to new entries
        drain(ingestor, client)
    assert task_counts(tasks) == first
    assert len(first) == 20
    assert ingestor.stats.duplicates == 60
    assert pending_total(client, keys.inbound()) == 0


def test_ingest_conflict_expired_and_hop_limit_get_replies_not_dead_letters(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    client = connect(redis_server.url)
    keys = Keys(prefix)
    pub = Publisher(client, keys, "alice", keyring)
    pub.publish(envelope("c1"))
    pub.publish(envelope("c1", payload={"other": True}))  # same identity, other content
    pub.publish(envelope("late", deadline=clock.now() - 1))
    pub.publish(envelope("loop", hops=tasks.policy.max_hops + 1))
    ingestor = _ingestor(client, prefix, tasks, keyring, clock)
    drain(ingestor, client)
    s = ingestor.stats
    assert (s.accepted, s.conflicts, s.expired, s.hop_limited) == (1, 1, 1, 1)
    assert client.xlen(keys.inbound_dead()) == 0
    assert pending_total(client, keys.inbound()) == 0
    replies = {r.message_id: r.status for r in OutboxStore(tasks.db, clock).list()}
    assert replies == {"c1": "conflict", "late": "expired", "loop": "hop_limit"}
    with tasks.db.read() as c:  # the first request stands, untouched by the conflict
        row = c.execute("SELECT payload FROM tasks WHERE message_id = 'c1'").fetchone()
    assert row is not None
    assert json.loads(row["payload"]) == envelope("c1").payload
    assert task_counts(tasks) == {("alice", "c1"): 1, ("alice", "late"): 1, ("alice", "loop"): 1}


def test_ingest_dead_letters_deadline_beyond_retention_window(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    """A deadline further ahead than the window is dead-lettered (``too_large`` on
    ``deadline``) with nothing stored; one at the edge and the rest of the batch go in."""
    client = connect(redis_server.url)
    keys = Keys(prefix)
    pub = Publisher(client, keys, "alice", keyring)
    window = tasks.policy.retention_s
    pub.publish(envelope("edge", deadline=clock.now() + window))
    far = xadd_signed(client, keys, keyring, envelope("far", deadline=clock.now() + window + 0.001))
    huge = xadd_signed(client, keys, keyring, envelope("huge", deadline=1e300))
    ingestor = _ingestor(client, prefix, tasks, keyring, clock)
    drain(ingestor, client)
    assert task_counts(tasks) == {("alice", "edge"): 1}
    assert pending_total(client, keys.inbound()) == 0
    dead = {
        text(f[b"dl.entry_id"]): (
            text(f[b"dl.reason"]),
            text(f[b"dl.field"]),
            text(f[b"dl.principal"]),
        )
        for _, f in _xrange(client, keys.inbound_dead())
    }
    assert dead == {
        text(far): ("too_large", "deadline", "alice"),
        text(huge): ("too_large", "deadline", "alice"),
    }
    assert ingestor.stats.dead_lettered == {"too_large": 2}


def test_ingest_replay_after_retention_window_never_runs_twice(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    """Anyone who can read the stream re-adds an entry's exact fields after the window: the
    replay is expired at once (its deadline lies inside the first window), never claimed."""
    client = connect(redis_server.url)
    keys = Keys(prefix)
    xadd_signed(
        client, keys, keyring, envelope("pay-1", deadline=clock.now() + tasks.policy.retention_s)
    )
    ((_, fields),) = _xrange(client, keys.inbound())
    ingestor = _ingestor(client, prefix, tasks, keyring, clock)
    drain(ingestor, client)
    (first,) = tasks.claim("w1")
    tasks.finish(first.task_id, "w1", first.fence, {"paid": True})
    outbox = OutboxStore(tasks.db, clock)
    (reply,) = outbox.claim("d1", 1)
    outbox.mark_sent(reply.reply_id, "d1", reply.fence, "1-0")

    clock.advance(tasks.policy.retention_s + 1)
    assert tasks.purge() == 1
    client.xadd(keys.inbound(), fields)  # type: ignore[arg-type]  # the same bytes again
    drain(ingestor, client)
    assert ingestor.stats.expired == 1
    assert tasks.claim("w2", 10) == []
    counts = tasks.counts()
    # The purge took the first request whole (task, record, reply): only the replay is left.
    assert (counts["done"], counts["expired"], counts["pending"], counts["running"]) == (0, 1, 0, 0)
    statuses = sorted(r.status for r in OutboxStore(tasks.db, clock).list())
    assert statuses == ["expired"]


# -- bad input -------------------------------------------------------------------------------

_MALLORY = ("mallory-1", b"mallory's own secret")


def _bad_cases() -> list[tuple[str, dict[bytes, bytes], str, str]]:
    ok = _canon(_raw_env(message_id="fine"))
    deep: dict[str, Any] = {"leaf": 1}
    for _ in range(17):
        deep = {"d": deep}
    cases: list[tuple[str, dict[bytes, bytes], str, str]] = [
        ("unparseable", _signed(b'{"message_id": '), "unparseable", ""),
        ("not_utf8", _signed(b'{"message_id":"\xff\xfe"}'), "not_utf8", ""),
        ("not_object", _signed(b"[1, 2]"), "not_object", ""),
        ("duplicate_key", _signed(b'{"message_id":"a","message_id":"b"}'), "unparseable", ""),
        ("nan", _signed(b'{"deadline":NaN}'), "unparseable", ""),
        ("oversize", _signed(_canon(_raw_env(payload={"s": "x" * 300_000}))), "oversize", ""),
        ("bad_version", {**_signed(ok), b"v": b"2"}, "bad_version", "v"),
        ("bad_signature", {**_signed(ok), b"sig": b"0" * 64}, "bad_signature", "sig"),
        (
            "tampered",
            {**_signed(ok), b"env": ok.replace(b'"x":1', b'"x":2')},
            "bad_signature",
            "sig",
        ),
        (
            "unknown_principal",
            _signed(_canon(_raw_env(sender="mallory")), _MALLORY),
            "unknown_principal",
            "sender",
        ),
        ("unknown_key", _signed(ok, ("alice-1999", b"guess")), "unknown_key", "kid"),
        ("sender_mismatch", _signed(ok, BOB), "sender_mismatch", "sender"),
        # valid JSON, correctly signed, but not a valid envelope
        ("no_message_id", _signed(_canon(_raw_env(message_id=_DROP))), "missing", "message_id"),
        ("no_payload", _signed(_canon(_raw_env(payload=_DROP))), "missing", "payload"),
        ("unknown_member", _signed(_canon(_raw_env(extra=1))), "unknown_field", "extra"),
        ("bad_kind", _signed(_canon(_raw_env(kind="job"))), "bad_value", "kind"),
        ("payload_list", _signed(_canon(_raw_env(payload=[1]))), "not_object", "payload"),
        ("too_deep", _signed(_canon(_raw_env(payload=deep))), "too_deep", "payload"),
        (
            "too_many_nodes",
            _signed(_canon(_raw_env(payload={"l": [0] * 10_001}))),
            "too_many_nodes",
            "payload",
        ),
        (
            "too_large",
            _signed(_canon(_raw_env(payload={"s": "x" * 70_000}))),
            "too_large",
            "payload",
        ),
        ("attempts_0", _signed(_canon(_raw_env(max_attempts=0))), "too_small", "max_attempts"),
        ("attempts_11", _signed(_canon(_raw_env(max_attempts=11))), "too_large", "max_attempts"),
        ("attempts_str", _signed(_canon(_raw_env(max_attempts="3"))), "bad_type", "max_attempts"),
        ("hops_negative", _signed(_canon(_raw_env(hops=-1))), "too_small", "hops"),
        ("deadline_0", _signed(_canon(_raw_env(deadline=0))), "not_positive", "deadline"),
        ("deadline_str", _signed(_canon(_raw_env(deadline="soon"))), "bad_type", "deadline"),
        ("id_empty", _signed(_canon(_raw_env(message_id=""))), "bad_length", "message_id"),
        ("id_long", _signed(_canon(_raw_env(message_id="i" * 129))), "bad_length", "message_id"),
        (
            "id_control",
            _signed(_canon(_raw_env(message_id="a\u0007b"))),
            "control_char",
            "message_id",
        ),
        ("sender_chars", _signed(_canon(_raw_env(sender="al ice"))), "bad_chars", "sender"),
        ("corr_type", _signed(_canon(_raw_env(correlation_id=5))), "bad_type", "correlation_id"),
        ("kind_result", _signed(_canon(_raw_env(kind="result"))), "not_task", "kind"),
        ("kind_event", _signed(_canon(_raw_env(kind="event"))), "not_task", "kind"),
    ]
    for name in (b"v", b"env", b"kid", b"sig"):
        fields = _signed(ok)
        del fields[name]
        cases.append((f"missing_{name.decode()}", fields, "missing_field", name.decode()))
    return cases


def test_ingest_dead_letters_every_bad_input_class_with_its_reason(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    client = connect(redis_server.url)
    keys = Keys(prefix)
    good = Publisher(client, keys, "alice", keyring)
    expected: dict[str, tuple[str, str, str]] = {}
    for i, (label, fields, reason, field) in enumerate(_bad_cases()):
        eid = text(client.xadd(keys.inbound(), fields))  # type: ignore[arg-type]
        expected[eid] = (label, reason, field)
        if i % 5 == 0:  # good entries mixed in, in the same batches
            good.publish(envelope(f"good-{i}"))
    ingestor = _ingestor(client, prefix, tasks, keyring, clock, count=8)
    drain(ingestor, client)

    dead = _xrange(client, keys.inbound_dead())
    got = {text(f[b"dl.entry_id"]): (text(f[b"dl.reason"]), text(f[b"dl.field"])) for _, f in dead}
    assert len(dead) == len(expected)  # each once, no duplicates
    mismatches = {
        label: got.get(eid)
        for eid, (label, reason, field) in expected.items()
        if got.get(eid) != (reason, field)
    }
    assert mismatches == {}
    assert task_counts(tasks) == {("alice", f"good-{i}"): 1 for i in range(0, len(expected), 5)}
    assert pending_total(client, keys.inbound()) == 0
    # the original bytes are kept, so nothing is lost
    not_utf8 = next(f for _, f in dead if f[b"dl.reason"] == b"not_utf8")
    assert not_utf8[b"orig.env"] == b'{"message_id":"\xff\xfe"}'
    assert sum(ingestor.stats.dead_lettered.values()) == len(expected)
    assert ingestor.stats.dead_lettered["sender_mismatch"] == 1


def test_ingest_spoofed_sender_never_gets_a_task(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    client = connect(redis_server.url)
    keys = Keys(prefix)
    Publisher(client, keys, "alice", keyring).publish(envelope("order-1"))
    spoof = _canon(_raw_env(message_id="order-1", payload={"evil": True}))
    spoof_new = _canon(_raw_env(message_id="order-2"))
    attempts = [
        _signed(spoof, BOB),  # bob's valid key, alice's name
        _signed(spoof_new, BOB),
        {**_signed(spoof, ALICE), b"sig": signature(BOB[1], ALICE[0], spoof).encode()},
        _signed(spoof, ("alice-2026", b"a guessed secret")),
    ]
    for fields in attempts:
        client.xadd(keys.inbound(), fields)  # type: ignore[arg-type]
    ingestor = _ingestor(client, prefix, tasks, keyring, clock)
    drain(ingestor, client)
    assert task_counts(tasks) == {("alice", "order-1"): 1}
    assert ingestor.stats.conflicts == 0  # the spoof never even reached alice's inbox row
    reasons = [f[b"dl.reason"] for _, f in _xrange(client, keys.inbound_dead())]
    assert reasons == [b"sender_mismatch", b"sender_mismatch", b"bad_signature", b"bad_signature"]
    assert OutboxStore(tasks.db, clock).list() == []


def test_ingest_dead_letters_entries_past_the_delivery_limit(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    client = connect(redis_server.url)
    keys = Keys(prefix)
    eid = xadd_signed(client, keys, keyring, envelope("poison"))
    client.xgroup_create(keys.inbound(), INGEST_GROUP, id="0")
    client.xreadgroup(INGEST_GROUP, "ingest-t-0", {keys.inbound(): ">"})
    client.xclaim(keys.inbound(), INGEST_GROUP, "ingest-t-0", 0, [eid], retrycount=9, justid=True)
    ingestor = _ingestor(client, prefix, tasks, keyring, clock, max_deliveries=5)
    drain(ingestor, client)
    assert task_counts(tasks) == {}
    assert ingestor.stats.dead_lettered == {"delivery_limit": 1}


# -- takeover and the run loop ---------------------------------------------------------------


def test_ingest_takes_over_a_dead_consumers_entries_after_min_idle(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    client, keys, _pub = _alice_published(redis_server, prefix, keyring, "t", 12)
    client.xgroup_create(keys.inbound(), INGEST_GROUP, id="0")
    # a consumer that read 12 entries and died before storing any of them
    client.xreadgroup(INGEST_GROUP, "ingest-dead-0", {keys.inbound(): ">"}, count=12)
    heir = _ingestor(
        client,
        prefix,
        tasks,
        keyring,
        clock,
        consumer="ingest-heir-0",
        count=5,
        claim_min_idle_ms=60_000,
    )
    assert heir.take_over() == 0  # not idle long enough yet: left alone
    assert heir.step() == 0
    assert pending_total(client, keys.inbound()) == 12
    assert age_pending(client, keys.inbound(), "ingest-dead-0") == 12
    assert heir.take_over() == 12  # pages of 5 until the scan completes
    assert heir.stats.taken_over == 12
    assert task_counts(tasks) == {("alice", f"t{i}"): 1 for i in range(12)}
    assert pending_total(client, keys.inbound()) == 0
    assert drained(client, keys.inbound())


def test_ingest_run_loop_takes_over_and_ingests_until_stopped(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    client, keys, pub = _alice_published(redis_server, prefix, keyring, "r", 5)
    client.xgroup_create(keys.inbound(), INGEST_GROUP, id="0")
    client.xreadgroup(INGEST_GROUP, "ingest-dead-0", {keys.inbound(): ">"}, count=2)
    age_pending(client, keys.inbound(), "ingest-dead-0")
    ingestor = _ingestor(client, prefix, tasks, keyring, clock, claim_every_s=30.0)
    stop = threading.Event()
    worker = threading.Thread(target=ingestor.run, args=(stop,))
    worker.start()
    try:
        _wait_for(lambda: len(task_counts(tasks)) == 5, what="first five tasks")
        for i in range(5, 9):
            pub.publish(envelope(f"r{i}"))
        _wait_for(lambda: len(task_counts(tasks)) == 9, what="four more tasks")
    finally:
        stop.set()
        worker.join(timeout=10)
    assert not worker.is_alive()
    assert ingestor.stats.taken_over == 2
    assert pending_total(client, keys.inbound()) == 0


def test_ingest_reads_ahead_with_its_xack_and_a_stop_leaves_nothing_read_unhandled(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    client, keys, _pub = _alice_published(redis_server, prefix, keyring, "p", 6)
    ingestor = _ingestor(client, prefix, tasks, keyring, clock, count=2)
    assert ingestor.step() == 0  # the replay of its own (empty) pending list
    assert ingestor.step() == 2  # p0, p1 stored and acked; p2, p3 read in the XACK's trip
    assert len(task_counts(tasks)) == 2
    assert pending_total(client, keys.inbound()) == 2
    assert ingestor.step() == 2  # p2, p3 from memory, no read of their own
    assert len(task_counts(tasks)) == 4
    stop = threading.Event()
    stop.set()
    ingestor.run(stop)  # stopped at once: only what was read ahead (p4, p5) is handled
    assert task_counts(tasks) == {("alice", f"p{i}"): 1 for i in range(6)}
    assert pending_total(client, keys.inbound()) == 0
    assert ingestor.stats.acked == 6


def test_ingest_prefetch_left_by_a_batch_of_dead_letters_is_handled_on_stop(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    """A full batch is followed by a read sent at once (``GroupReader.prefetch``). When the
    batch is all dead letters no XACK takes that read's reply: the next read does, and a
    stop still handles it (nothing is left read and unhandled)."""
    client = connect(redis_server.url)
    keys = Keys(prefix)
    for _ in range(2):
        client.xadd(keys.inbound(), {b"v": b"1", b"env": b"not json"})
    pub = Publisher(client, keys, "alice", keyring)
    for i in range(2):
        pub.publish(envelope(f"d{i}"))
    ingestor = _ingestor(client, prefix, tasks, keyring, clock, count=2)
    assert ingestor.step() == 0  # the replay of its own (empty) pending list
    assert ingestor.step() == 2  # both dead-lettered; the next two read in the meantime
    assert ingestor.readers[0].has_ahead
    assert task_counts(tasks) == {}
    stop = threading.Event()
    stop.set()
    ingestor.run(stop)
    assert task_counts(tasks) == {("alice", "d0"): 1, ("alice", "d1"): 1}
    assert pending_total(client, keys.inbound()) == 0
    assert len(client.xrange(keys.inbound_dead()) or []) == 2


def test_ingest_run_loop_backs_off_and_recovers_when_redis_restarts(
    fresh_redis: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    client = connect(fresh_redis.url, socket_timeout_s=1.0)
    _publish_many(client, prefix, keyring, 6, "u")
    ingestor = _ingestor(client, prefix, tasks, keyring, clock, count=4)
    stop = threading.Event()
    worker = threading.Thread(target=ingestor.run, args=(stop,))
    worker.start()
    try:
        _wait_for(lambda: len(task_counts(tasks)) == 6, what="the first tasks")
        fresh_redis.kill()
        _wait_for(lambda: ingestor.stats.transient_errors >= 2, what="the loop to back off")
        fresh_redis.restart()
        _publish_many(client, prefix, keyring, 9, "u")  # 6 resends and 3 new requests
        _wait_for(lambda: len(task_counts(tasks)) == 9, what="tasks after the restart")
        _wait_for(lambda: drained(client, Keys(prefix).inbound()), what="the stream to drain")
    finally:
        stop.set()
        worker.join(timeout=10)
    assert not worker.is_alive()
    assert task_counts(tasks) == {("alice", f"u{i}"): 1 for i in range(9)}
    # 6 resends, plus the last batch again if the kill landed between its commit and its
    # XACK (redelivered after the restart): duplicates, never second tasks.
    assert 6 <= ingestor.stats.duplicates <= 6 + 4


# -- faults ----------------------------------------------------------------------------------


def _publish_many(client: redis.Redis, prefix: str, keyring: Keyring, n: int, tag: str) -> None:
    pub = Publisher(client, Keys(prefix), "alice", keyring)
    for i in range(n):
        pub.publish(envelope(f"{tag}{i}"))


def test_ingest_connection_killed_mid_batch_loses_and_doubles_nothing(
    fresh_redis: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    client = connect(fresh_redis.url)
    admin = fresh_redis.client()
    keys = Keys(prefix)
    _publish_many(client, prefix, keyring, 30, "k")
    store = CountingStore(tasks)
    ingestor = _ingestor(client, prefix, store, keyring, clock, count=10)
    victim = int(client.client_id())

    def pause_writes(call: int) -> None:
        if call == 2:  # batch 2 is committed; its XACK will hang in the pause
            fresh_redis.client().client_pause(30_000, all=False)

    store.after_commit = pause_writes
    errors: list[RedisUnavailable] = []

    def run_steps() -> None:
        try:
            for _ in range(5):
                ingestor.step()
        except RedisUnavailable as exc:  # anything else fails the test below
            errors.append(exc)

    worker = threading.Thread(target=run_steps)
    worker.start()

    def victim_blocked_in_xack() -> bool:
        return any(
            int(c["id"]) == victim and c["cmd"] == "xack" and "b" in c["flags"]
            for c in admin.client_list()
        )

    try:
        _wait_for(victim_blocked_in_xack, what="the XACK to hang in CLIENT PAUSE")
        assert admin.client_kill_filter(_id=str(victim)) == 1
    finally:
        admin.client_unpause()
        worker.join(timeout=10)
    assert len(errors) == 1
    assert isinstance(errors[0], RedisUnavailable)  # "maybe acknowledged"
    # The kill discarded the XACK of batch 2; batch 3 was read ahead (``prefetch``) while
    # batch 2 was checked and committed: both are pending.
    assert pending_total(client, keys.inbound()) == 20
    drain(ingestor, client)
    assert task_counts(tasks) == {("alice", f"k{i}"): 1 for i in range(30)}
    assert ingestor.stats.duplicates == 10  # batch 2 replayed from the pending list
    assert pending_total(client, keys.inbound()) == 0


def test_ingest_client_pause_longer_than_socket_timeout(
    fresh_redis: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    client = connect(fresh_redis.url, socket_timeout_s=0.3)
    admin = fresh_redis.client()
    keys = Keys(prefix)
    _publish_many(client, prefix, keyring, 25, "p")
    store = CountingStore(tasks)
    ingestor = _ingestor(client, prefix, store, keyring, clock, count=10, block_ms=50)

    def pause_after_first_commit(call: int) -> None:
        if call == 1:
            admin.client_pause(60_000, all=False)  # WRITE pause: XACK, XREADGROUP, EVAL wait

    store.after_commit = pause_after_first_commit
    ingestor.step()  # the pending replay: empty
    with pytest.raises(RedisUnavailable):
        ingestor.step()  # batch 1 committed, its XACK times out in the pause
    with pytest.raises(RedisUnavailable):
        ingestor.step()  # the replay read times out too
    admin.client_unpause()
    drain(ingestor, client)
    assert task_counts(tasks) == {("alice", f"p{i}"): 1 for i in range(25)}
    assert ingestor.stats.duplicates == 10
    assert pending_total(client, keys.inbound()) == 0


def test_ingest_redis_killed_and_restarted_from_aof(
    fresh_redis: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    client = connect(fresh_redis.url, socket_timeout_s=2.0)
    keys = Keys(prefix)
    _publish_many(client, prefix, keyring, 30, "a")
    store = CountingStore(tasks)
    ingestor = _ingestor(client, prefix, store, keyring, clock, count=8)

    def restart_after_second_commit(call: int) -> None:
        if call == 2:
            fresh_redis.restart()  # SIGKILL + start from the AOF, between COMMIT and XACK

    store.after_commit = restart_after_second_commit
    ingestor.step()
    ingestor.step()  # batch 1 stored and acknowledged
    try:
        ingestor.step()  # batch 2 stored, then redis-server is SIGKILLed and restarted
    except RedisUnavailable:
        pass  # the XACK may fail or go to the restarted server: either is fine
    fresh_redis.kill()
    with pytest.raises(RedisUnavailable):
        ingestor.step()  # server down: connection refused
    fresh_redis.restart()
    _publish_many(client, prefix, keyring, 5, "b")
    drain(ingestor, client)
    assert client.xlen(keys.inbound()) == 35  # every acknowledged publish survived (AOF always)
    expected = {("alice", f"a{i}"): 1 for i in range(30)} | {
        ("alice", f"b{i}"): 1 for i in range(5)
    }
    assert task_counts(tasks) == expected
    assert pending_total(client, keys.inbound()) == 0


# -- publishers and configuration ------------------------------------------------------------


def test_publisher_resend_is_a_duplicate_and_async_publisher_works(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    client = connect(redis_server.url)
    keys = Keys(prefix)
    pub = Publisher(client, keys, "alice", keyring, key_id="alice-2025")
    first = pub.publish(envelope("resent"))
    second = pub.publish(envelope("resent"))  # e.g. after a RedisUnavailable: maybe published
    assert first == second == "resent"  # the message id; the adapter picks the entry ids
    assert client.llen(keys.submit()) == 2  # two copies published

    async def publish_async() -> list[str]:
        aclient = connect_async(redis_server.url)
        try:
            apub = AsyncPublisher(aclient, keys, "bob", keyring)
            return [await apub.publish(envelope(f"async-{i}", sender="bob")) for i in range(3)]
        finally:
            await aclient.aclose()

    assert len(asyncio.run(publish_async())) == 3
    with pytest.raises(AuthError) as info:
        pub.publish(envelope("as-bob", sender="bob"))
    assert info.value.reason == "sender_mismatch"
    ingestor = _ingestor(client, prefix, tasks, keyring, clock)
    drain(ingestor, client)
    assert task_counts(tasks) == {("alice", "resent"): 1} | {
        ("bob", f"async-{i}"): 1 for i in range(3)
    }
    assert ingestor.stats.duplicates == 1
    assert client.xlen(keys.inbound()) == 5  # no MAXLEN: nothing trimmed


def test_publisher_and_ingest_config_are_checked(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring
) -> None:
    client = connect(redis_server.url, socket_timeout_s=1.0)
    keys = Keys(prefix)
    with pytest.raises(ConfigError):
        Publisher(client, keys, "carol", keyring)
    with pytest.raises(ConfigError):
        Publisher(client, keys, "alice", keyring, key_id="bob-1")
    with pytest.raises(ConfigError):
        Publisher(client, keys, "alice", None, key_id="alice-2026")
    with pytest.raises(ConfigError, match="socket timeout"):
        Ingestor(IngestConfig(consumer="c", block_ms=1000), client, tasks, keyring)
    with pytest.raises(ConfigError, match="keyring"):
        Ingestor(IngestConfig(consumer="c", block_ms=10), client, tasks, None)
    for bad in (
        {"consumer": ""},
        {"consumer": "has space"},
        {"consumer": "c", "mode": "acl"},
        {"consumer": "c", "acl_principals": ("alice",)},
        {"consumer": "c", "mode": "acl", "acl_principals": ("a", "a")},
        {"consumer": "c", "mode": "acl", "acl_principals": ("bad name",)},
        {"consumer": "c", "block_ms": 0},
        {"consumer": "c", "count": 0},
        {"consumer": "c", "prefix": "a{b}"},
        {"consumer": "c", "surprise": 1},
    ):
        with pytest.raises(ConfigError, match=r"^IngestConfig"):
            IngestConfig(**bad)
    config = IngestConfig(consumer="c")
    with pytest.raises(pydantic.ValidationError):
        config.count = 5  # type: ignore[misc]


def test_ingest_busy_store_holds_the_batch_and_spends_no_delivery_count(
    redis_server: RedisServer, prefix: str, tmp_path: Path, keyring: Keyring, clock: FakeClock
) -> None:
    """A store outage must not turn good requests into poison: the checked batch is kept and
    retried as it is, not read again (each re-read would raise its Redis delivery count)."""
    import sqlite3

    from broker_adapter.errors import StoreBusy
    from broker_adapter.store.db import Database

    client = connect(redis_server.url)
    _publish_many(client, prefix, keyring, 3, "busy")
    db_path = tmp_path / "busy.db"
    db = Database(db_path, busy_timeout_ms=20)
    ingest = Ingestor(
        IngestConfig(prefix=prefix, consumer="busy-1", block_ms=50, max_deliveries=3),
        client,
        TaskStore(db, clock),
        keyring,
    )
    ingest.step()  # own pending list: empty
    holder = sqlite3.connect(str(db_path), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # someone else holds the write lock
    failures = 0
    for _ in range(8):  # more failures than max_deliveries
        try:
            ingest.step()
        except StoreBusy:
            failures += 1
    holder.execute("COMMIT")
    holder.close()
    assert failures == 8
    assert ingest.step() == 3
    assert client.xlen(Keys(prefix).inbound_dead()) == 0
    assert task_counts(TaskStore(db)) == {("alice", f"busy{i}"): 1 for i in range(3)}
    pending = client.xpending_range(Keys(prefix).inbound(), INGEST_GROUP, "-", "+", 10)
    assert pending == []
    db.close()


def test_partitions_block_only_after_a_round_that_found_every_stream_empty(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring
) -> None:
    """With several inbound streams read in turn, traffic on one of them must not wait out
    a blocking read on each idle one: after a round that handled entries every read is
    non-blocking; only a round that found nothing lets the next one block."""
    client = connect(redis_server.url)
    pub = Publisher(client, Keys(prefix), "alice", keyring, partitions=4)
    ingestor = _ingestor(
        client, prefix, tasks, keyring, FakeClock(1_800_000_000.0), partitions=4, block_ms=400
    )
    blocking: list[list[bool]] = []
    for reader in ingestor.readers:
        original = reader.read

        def read(*, block: bool = True, _original: Any = original) -> Any:
            blocking[-1].append(block)
            return _original(block=block)

        reader.read = read  # type: ignore[method-assign]
    handled: list[int] = []
    for i in range(8):
        if i in (2, 3, 4):
            pub.publish(envelope(f"busy-{i}"))  # all of alice's traffic on one partition
        blocking.append([])
        handled.append(ingestor.step(peek=False))
    assert sum(handled) == 3
    assert len(task_counts(tasks)) == 3
    assert blocking[0] == [True] * 4  # nothing was handled before the first round
    for before, reads in zip(handled, blocking[1:], strict=False):
        assert reads == [before == 0] * 4, (handled, blocking)
    assert any(h > 0 for h in handled[:-1])  # a busy round was followed by a fast one
