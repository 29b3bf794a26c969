"""The streams on a real 3-master Redis Cluster with one replica (``redis+cluster://``):
publish → ingest (over partitions on several masters) → reply → receive; a slot migrated
under a reader (ASK, then MOVED); a master SIGKILLed mid-run with its replica promoted."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot
from redis.exceptions import AskError

from broker_adapter.backoff import retrying
from broker_adapter.client.publisher import AsyncPublisher, Publisher
from broker_adapter.clock import FakeClock
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import Keys, partition_of
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect, connect_async
from broker_adapter.redis.reader import GroupReader
from broker_adapter.redis.reader_config import ReaderConfig
from broker_adapter.redis.scripts import eval_many
from broker_adapter.stages.dispatch.loss import LossEvent
from broker_adapter.stages.ingest.config import IngestConfig
from broker_adapter.stages.ingest.ingest import Ingestor
from broker_adapter.store import TaskStore, open_database
from broker_adapter.store.db import Database
from tests.support.cli import count_rows, publish_range, wait_for
from tests.support.ingest_script import envelope
from tests.support.redis_cluster import (  # noqa: F401 - the fixtures
    REPLICATED_SLOT,
    RedisCluster,
    fresh_redis_cluster,
    redis_cluster,
)
from tests.support.replies_script import dispatcher_for, drain, effect_counts, receiver_for

pytestmark = pytest.mark.integration

PRINCIPALS = ("alice", "bob")


def _slot(key: str) -> int:
    return key_slot(key.encode("utf-8"))


def _ingestor(url: str, prefix: str, tasks: TaskStore, keyring: Keyring, **cfg: Any) -> Ingestor:
    config = IngestConfig(prefix=prefix, consumer="c1", block_ms=20, **cfg)
    return Ingestor(config, connect(url), tasks, keyring, clock=tasks.clock)


def _ingest_all(ingestor: Ingestor, want: int) -> None:
    for _ in range(200):
        ingestor.step()
        if ingestor.stats.accepted >= want:
            return
    raise AssertionError(f"ingested {ingestor.stats.accepted} of {want}")


def test_publish_ingest_reply_receive_through_the_cluster(
    redis_cluster: RedisCluster,  # noqa: F811
    prefix: str,
    tasks: TaskStore,
    keyring: Keyring,
    rx_db: Database,
    rx_path: Path,
    clock: FakeClock,
) -> None:
    partitions = 3
    keys = Keys(prefix)
    url = redis_cluster.url
    publishers = {
        p: Publisher(connect(url), keys, p, keyring, partitions=partitions) for p in PRINCIPALS
    }
    # Each principal writes its own partition, and the partitions are on several masters.
    for p, pub in publishers.items():
        assert pub.stream == keys.inbound_partition(partition_of(p, partitions))
    owners = {redis_cluster.owner(_slot(s)).port for s in keys.inbound_partitions(partitions)}
    assert len(owners) >= 2
    sent = [(p, f"m{i}") for p in PRINCIPALS for i in range(20)]
    for p, mid in sent:
        publishers[p].publish(envelope(mid, sender=p))
    junk = keys.inbound_partition(2)
    connect(url).xadd(junk, {"not": "an envelope"})

    ingestor = _ingestor(url, prefix, tasks, keyring, partitions=partitions)
    _ingest_all(ingestor, len(sent))
    assert ingestor.stats.accepted == len(sent)
    assert all(tasks.find(p, mid) is not None for p, mid in sent)
    # The junk went to its partition's dead letters (the dead-letter script, one slot).
    assert ingestor.step() == 0
    assert connect(url).xlen(keys.dead_for(junk)) == 1
    ingestor.trim()  # the trim script on each partition's master

    claimed = tasks.claim("worker", len(sent))
    reply_ids = [tasks.finish(t.task_id, "worker", t.fence, {"ok": True}) for t in claimed]
    dispatcher = dispatcher_for(url, tasks.db, clock, prefix, "d1")
    dispatcher.watch()  # the data-loss watch (GET epoch + INFO) on the epoch key's master
    while dispatcher.step():
        pass
    for p in PRINCIPALS:
        drain(receiver_for(url, rx_db, clock, prefix, p, "r1"))
    assert effect_counts(rx_path) == dict.fromkeys(reply_ids, 1)


def _reader(url: str, stream: str, **cfg: int) -> GroupReader:
    config = ReaderConfig(block_ms=20, **cfg)
    return GroupReader(connect(url), stream, "g", "c1", Keys().dead_for(stream), config)


def _read_all(reader: GroupReader, want: int) -> list[str]:
    """Entry ids read (and acknowledged, peeking) until ``want`` were seen."""
    seen: list[str] = []
    for _ in range(100):
        batch = reader.read()
        seen += [e.entry_id for e in batch]
        if batch:
            reader.ack([e.entry_id for e in batch], peek=True)
        if len(seen) >= want:
            break
    return seen


def test_a_slot_migrated_under_a_reader_is_followed_through_ask_and_moved(
    redis_cluster: RedisCluster,  # noqa: F811
    prefix: str,
) -> None:
    stream = f"{prefix}:{{mig.{prefix}}}:tasks"
    slot = _slot(stream)
    reader = _reader(redis_cluster.url, stream, count=5)
    writer = connect(redis_cluster.url)
    reader.ensure_group()
    ids = [writer.xadd(stream, {"n": str(i)}).decode() for i in range(30)]  # type: ignore[union-attr]
    first = _read_all(reader, 10)
    source = redis_cluster.owner(slot)
    target = next(m for m in redis_cluster.live_masters() if m is not source)

    # Mid-migration: the key moved, the slot not yet: the source answers ASK.
    redis_cluster.begin_migration(slot, target)
    redis_cluster.move_keys(slot, source, target)
    with source.client() as plain, pytest.raises(AskError):
        plain.xlen(stream)
    during = _read_all(reader, 10)
    ids.append(writer.xadd(stream, {"n": "during"}).decode())  # type: ignore[union-attr]
    # The slot handed over: the source answers MOVED; the readers' map follows.
    redis_cluster.end_migration(slot, target)
    assert redis_cluster.owner(slot) is target
    after = _read_all(reader, len(ids) - len(first) - len(during))
    got = first + during + after
    assert sorted(got) == sorted(ids)
    assert len(set(got)) == len(got)  # nothing read twice
    assert reader.pending() == {}


def test_a_killed_master_is_replaced_by_its_replica_and_ingest_goes_on(
    fresh_redis_cluster: RedisCluster,  # noqa: F811
    tmp_path: Path,
    keyring: Keyring,
) -> None:
    """Publishes run on while the master of ``{in}`` is SIGKILLed and its replica
    promoted. What the dead master acknowledged and had replicated (the replica's offset
    had reached the master's) is all ingested; what it had not may be lost (the
    asynchronous-replication window) and comes back with the end-to-end resend of the
    same envelopes; nothing is stored twice."""
    cluster = fresh_redis_cluster
    assert cluster.owner(REPLICATED_SLOT) is cluster.replicated_master
    keys = Keys("fo")
    url = cluster.url
    db_path = tmp_path / "inbox.db"
    stop = threading.Event()
    errors: list[BaseException] = []
    ingestors: list[Ingestor] = []

    def ingest() -> None:
        db = open_database(db_path)
        try:
            ingestors.append(_ingestor(url, "fo", TaskStore(db, FakeClock()), keyring))
            ingestors[0].run(stop)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            db.close()

    thread = threading.Thread(target=ingest, daemon=True)
    thread.start()
    client = connect(url)
    publisher = Publisher(client, keys, "alice", keyring)
    outbox_db = open_database(tmp_path / "outbox.db")
    dispatcher = dispatcher_for(url, outbox_db, FakeClock(), "fo", "d1")
    assert dispatcher.watch().event is LossEvent.NONE
    assert _slot(publisher.stream) == REPLICATED_SLOT
    total, replicated, published = 300, set[str](), dict[str, Envelope]()
    killed_at: int | None = None
    try:
        for i in range(total):
            env = envelope(f"f{i}")
            _publish_until_done(publisher, env)
            published[env.message_id] = env
            if i % 10 == 9 and killed_at is None and cluster.replica_caught_up():
                replicated.update(f"f{j}" for j in range(i + 1))
            if killed_at is None and i == total // 2:  # a slow ingest catches up first
                wait_for(
                    lambda: count_rows(db_path, "SELECT count(*) FROM tasks") >= total // 3,
                    "a third of the tasks stored",
                )
            stored = count_rows(db_path, "SELECT count(*) FROM tasks")
            if killed_at is None and stored >= total // 3:
                killed_at = i
                cluster.kill_and_promote()
                # The dispatcher's loss watch sees the failover as a restart (the replies
                # sent just before it are published again).
                for attempt in retrying(max_wait_s=0.5):
                    with attempt:
                        assert dispatcher.watch().event is LossEvent.RESTART
        assert killed_at is not None
        after_kill = {f"f{j}" for j in range(killed_at + 1, total)}
        wait_for(lambda: _stored(db_path) >= replicated | after_kill, "the ingest caught up")
        # The end-to-end resend: a sender resends, with the same id, what has no reply.
        lost = set(published) - _stored(db_path)
        assert not lost & replicated  # loss only inside the replication window
        for mid in sorted(lost):
            _publish_until_done(publisher, published[mid])
        wait_for(lambda: _stored(db_path) == set(published), "every envelope ingested")
    finally:
        stop.set()
        thread.join(timeout=30)
        outbox_db.close()
    assert not errors
    assert ingestors[0].stats.transient_errors >= 1  # it did see the master die
    rows = _stored_rows(db_path)
    assert Counter(rows).most_common(1)[0][1] == 1  # nothing stored twice
    assert len(rows) == total


def _publish_until_done(publisher: Publisher, env: Envelope) -> None:
    """Publish, resending the SAME envelope while Redis is unavailable (the failover),
    with the library's backoff policy."""
    for attempt in retrying(max_wait_s=0.5):
        with attempt:
            publisher.publish(env)


def _stored_rows(db_path: Path) -> list[str]:
    import sqlite3

    conn = sqlite3.connect(db_path, timeout=10)
    try:
        return [str(r[0]) for r in conn.execute("SELECT message_id FROM tasks")]
    except sqlite3.OperationalError:
        return []
    finally:
        conn.close()


def _stored(db_path: Path) -> set[str]:
    return set(_stored_rows(db_path))


def test_one_round_trip_of_scripts_on_several_masters_runs_each_where_its_keys_are(
    redis_cluster: RedisCluster,  # noqa: F811
    prefix: str,
) -> None:
    keys = [f"{prefix}:{{k{i}}}:x" for i in range(12)]
    assert len({redis_cluster.owner(_slot(k)).port for k in keys}) == 3
    client = connect(redis_cluster.url)
    script = f"return redis.call('INCR', KEYS[1]) -- {prefix}"  # new to every master
    assert eval_many(client, script, [([k], []) for k in keys]) == [1] * len(keys)
    assert eval_many(client, script, [([k], []) for k in keys]) == [2] * len(keys)
    assert [int(client.get(k)) for k in keys] == [2] * len(keys)  # type: ignore[arg-type]


def test_the_function_library_is_loaded_on_every_master_and_dead_letters_anywhere(
    redis_cluster: RedisCluster,  # noqa: F811
    prefix: str,
) -> None:
    """``functions load`` reaches every master: a dead letter by FCALL runs where its
    stream's slot is, on each of the three masters, in one round trip."""
    from broker_adapter.redis.functions import DEAD_LETTER, fcall_many, load_functions

    streams = [f"{prefix}:{{in.p{i}}}:tasks" for i in range(12)]
    assert len({redis_cluster.owner(_slot(s)).port for s in streams}) == 3
    client: Any = connect(redis_cluster.url)
    load_functions(client)
    for node in client.get_primaries():
        listed = client.execute_command("FUNCTION", "LIST", target_nodes=node)
        assert listed, node  # every master has the library
    calls = [([s, f"{s}:dead"], ["g", "0-0", "0", "dl.reason", "test"]) for s in streams]
    results = fcall_many(client, DEAD_LETTER, calls)
    assert all(not isinstance(r, Exception) for r in results), results
    assert [client.xlen(f"{s}:dead") for s in streams] == [1] * len(streams)


def test_cli_run_publish_receive_status_on_the_cluster_with_partitions(
    redis_cluster: RedisCluster,  # noqa: F811
    tmp_path: Path,
    keyring: Keyring,
    prefix: str,
) -> None:
    from tests.integration.test_cli import _receipts, _receive, _start_run, _stop
    from tests.support.cli import run_cli as _cli

    url, keys_file = redis_cluster.url, tmp_path / "keys.json"  # the keyring fixture's file
    n, db, rdb = 6, tmp_path / "adapter.db", tmp_path / "receiver.db"
    for p in PRINCIPALS:
        publish_range(url, keys_file, prefix, range(n), "--partitions", "3", principal=p)
    keys, client = Keys(prefix), connect(url)
    junk = keys.inbound_partition(1)
    client.xadd(junk, {"v": "1", "env": "{not json", "kid": "k1", "sig": "00"})
    proc = _start_run(url, db, keys_file, prefix, "--partitions", "3")
    try:
        wait_for(
            lambda: count_rows(db, "SELECT count(*) FROM outbox WHERE state = 'sent'") == 2 * n,
            "all replies sent",
        )
        wait_for(lambda: client.xlen(keys.dead_for(junk)) == 1, "the dead letter")
    finally:
        assert _stop(proc) == 0
    for p in PRINCIPALS:
        _receive(url, rdb, prefix, p, keys_file)
    receipts = _receipts(rdb)
    assert sorted(r["message_id"] for r in receipts) == sorted([f"m{i}" for i in range(n)] * 2)
    assert all(r["effects"] == 1 and r["status"] == "done" for r in receipts)
    common = ["--db", str(db), "--redis", url, "--prefix", prefix, "--json"]
    status = _cli("status", *common)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    # SCAN went over every master: every partition (the ingest created the empty ones).
    assert set(report["redis"]["inbound"]) == set(keys.inbound_partitions(3))
    assert all(s["pending"] == 0 for s in report["redis"]["inbound"].values())
    # A dead letter goes back to its partition (MULTI/EXEC within one slot).
    (item,) = [
        json.loads(line) for line in _cli("dead-letters", "list", *common).stdout.splitlines()
    ]
    replayed = _cli("dead-letters", "replay", *common, item["entry_id"])
    assert replayed.returncode == 0, replayed.stderr
    assert json.loads(replayed.stdout)["replayed_to"] == junk
    assert client.xlen(keys.dead_for(junk)) == 0


def test_the_async_publisher_writes_its_partition_on_the_cluster(
    redis_cluster: RedisCluster,  # noqa: F811
    prefix: str,
    keyring: Keyring,
) -> None:
    keys = Keys(prefix)

    async def publish() -> str:
        client = connect_async(redis_cluster.url)
        try:
            publisher = AsyncPublisher(client, keys, "bob", keyring, partitions=4)
            return await publisher.publish(envelope("a1", sender="bob"))
        finally:
            await client.aclose()

    assert asyncio.run(publish()) == "a1"  # the message id: the adapter picks the entry id
    submit = keys.submit_partition(partition_of("bob", 4))
    items: Any = connect(redis_cluster.url).lrange(submit, 0, -1)
    assert [json.loads(i)[:4] for i in items] == [
        ["v", "1", "env", envelope("a1", sender="bob").to_json().decode()]
    ]
