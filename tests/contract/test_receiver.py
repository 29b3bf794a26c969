"""The receiver's contract, on a redis-server and on fakeredis: once-only effects, duplicates,
conflicts, bad entries, rewinds, failing effects and takeover of a dead consumer's entries."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.errors import ConfigError
from broker_adapter.protocol.canonical import canonical_json, sha256_hex
from broker_adapter.protocol.keys import RECEIVER_GROUP, Keys
from broker_adapter.protocol.reply import Reply, load_body
from broker_adapter.stages.receiver.receiver import Receiver, ReceiverConfig, effect_key
from broker_adapter.store import ReceiptStore
from broker_adapter.store.db import Database
from tests.support.backends import Backend
from tests.support.replies_script import (
    dispatcher_for,
    drain,
    effect_counts,
    make_replies,
    receiver_for,
    record_effect,
    reply_keyring,
)

P = "alice"


class _Rx(NamedTuple):
    """What most receiver tests start from: a Redis, the agent's and the receiver's files,
    the clock and a fresh key prefix."""

    backend: Backend
    agent_db: Database
    rx_db: Database
    rx_path: Path
    clock: FakeClock
    prefix: str


@pytest.fixture
def rx(
    backend: Backend,
    agent_db: Database,
    rx_db: Database,
    rx_path: Path,
    clock: FakeClock,
    prefix: str,
) -> _Rx:
    return _Rx(backend, agent_db, rx_db, rx_path, clock, prefix)


def _publish(
    backend: Backend, agent_db: Database, clock: FakeClock, prefix: str, n: int
) -> list[str]:
    ids = make_replies(agent_db, clock, P, n)
    assert dispatcher_for(backend.connect(), agent_db, clock, prefix, "d1").step() == n
    return ids


def _client(backend: Backend) -> Any:
    return backend.client()


def _signed(fields: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """``fields`` with the ``kid`` and ``sig`` the adapter would give them (P's first key)."""
    kid, sig = reply_keyring().sign_reply(P, fields[b"reply_id"].decode(), fields[b"body"])
    return {**fields, b"kid": kid.encode(), b"sig": sig.encode()}


def _raw_reply(reply_id: str, **extra: Any) -> dict[bytes, bytes]:
    made = {"finished_at": FakeClock().now()}  # the receivers' clock: within their window
    body = canonical_json({"reply_id": reply_id, "principal": P, "status": "done", **made, **extra})
    return _signed(
        {
            b"v": b"2",
            b"reply_id": reply_id.encode(),
            b"hash": sha256_hex(body).encode(),
            b"body": body,
        }
    )


def test_receiver_applies_each_reply_once_and_acks(rx: _Rx) -> None:
    backend, agent_db, rx_db, rx_path, clock, prefix = rx
    ids = _publish(backend, agent_db, clock, prefix, 4)
    rc = receiver_for(backend.connect(), rx_db, clock, prefix, P, "r1")
    assert drain(rc) == 4
    assert effect_counts(rx_path) == dict.fromkeys(ids, 1)
    assert rc.stats.applied == 4
    assert rc.reader.pending() == {}
    receipt = rc.receipts.get(ids[0])
    assert receipt is not None
    assert receipt.effects == 1
    assert json.loads(receipt.effect_result or "null") == {"applied": ids[0]}


def test_receiver_second_entry_of_same_reply_is_a_duplicate(rx: _Rx) -> None:
    backend, agent_db, rx_db, rx_path, clock, prefix = rx
    (rid,) = _publish(backend, agent_db, clock, prefix, 1)
    client = _client(backend)
    stream = Keys(prefix).replies(P)
    ((_, fields),) = client.xrange(stream)
    client.xadd(stream, fields)  # e.g. a resend after the record's retention ran out
    rc = receiver_for(backend.connect(), rx_db, clock, prefix, P, "r1")
    assert drain(rc) == 2
    assert (rc.stats.applied, rc.stats.duplicates) == (1, 1)
    assert effect_counts(rx_path) == {rid: 1}


def test_receiver_rewind_of_the_group_produces_zero_new_effects(rx: _Rx) -> None:
    backend, agent_db, rx_db, rx_path, clock, prefix = rx
    ids = _publish(backend, agent_db, clock, prefix, 3)
    rc = receiver_for(backend.connect(), rx_db, clock, prefix, P, "r1")
    drain(rc)
    _client(backend).xgroup_setid(Keys(prefix).replies(P), RECEIVER_GROUP, "0")
    assert drain(rc) == 3  # everything read and acknowledged again ...
    assert rc.stats.duplicates == 3
    assert effect_counts(rx_path) == dict.fromkeys(ids, 1)  # ... with no new effect
    assert rc.reader.pending() == {}


def test_receiver_refuses_conflicting_content_without_running_the_effect(
    backend: Backend, rx_db: Database, rx_path: Path, clock: FakeClock, prefix: str
) -> None:
    client = _client(backend)
    stream = Keys(prefix).replies(P)
    client.xadd(stream, _raw_reply("r-1", result=1))
    client.xadd(stream, _raw_reply("r-1", result=2))  # same reply id, other content
    rc = receiver_for(backend.connect(), rx_db, clock, prefix, P, "r1")
    assert drain(rc) == 1
    assert effect_counts(rx_path) == {"r-1": 1}
    (dead,) = client.xrange(Keys(prefix).replies_dead(P))
    assert dead[1][b"dl.reason"] == b"reply_conflict"
    assert json.loads(dead[1][b"orig.body"])["result"] == 2
    assert rc.stats.conflicts == 1
    assert rc.reader.pending() == {}
    receipt = rc.receipts.get("r-1")
    assert receipt is not None
    assert json.loads(receipt.body)["result"] == 1


def _with_body(fields: dict[bytes, bytes], body: bytes) -> dict[bytes, bytes]:
    return _signed({**fields, b"body": body, b"hash": sha256_hex(body).encode()})


def _unsigned(fields: dict[bytes, bytes], *drop: bytes) -> dict[bytes, bytes]:
    return {k: v for k, v in fields.items() if k not in drop}


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({b"v": b"2", b"reply_id": b"r-x"}, b"bad_reply"),
        ({**_raw_reply("r-x"), b"v": b"9"}, b"bad_reply"),
        (_unsigned({**_raw_reply("r-x"), b"v": b"1"}, b"kid", b"sig"), b"bad_reply"),
        (_unsigned(_raw_reply("r-x"), b"sig"), b"missing_field"),
        (_unsigned(_raw_reply("r-x"), b"kid"), b"missing_field"),
        ({**_raw_reply("r-x"), b"kid": b"alice-1999"}, b"unknown_key"),
        ({**_raw_reply("r-x"), b"sig": b"0" * 64}, b"bad_signature"),
        ({**_raw_reply("r-x"), b"reply_id": b"r-other"}, b"bad_signature"),
        (_signed({**_raw_reply("r-x"), b"reply_id": b"r-x\n"}), b"bad_reply"),
        ({**_raw_reply("r-x"), b"hash": b"0" * 64}, b"bad_hash"),
        ({**_raw_reply("r-x"), b"hash": b"nothex"}, b"bad_hash"),
        (_signed({**_raw_reply("r-x"), b"reply_id": b"r-other"}), b"bad_reply"),
        (_raw_reply("r-x", principal="mallory"), b"wrong_principal"),
        (_with_body(_raw_reply("r-x"), b"\xff"), b"bad_reply"),
        (_with_body(_raw_reply("r-x"), b"[1]"), b"bad_reply"),
    ],
)
def test_receiver_dead_letters_malformed_entries_with_reason(
    backend: Backend,
    rx_db: Database,
    rx_path: Path,
    clock: FakeClock,
    prefix: str,
    fields: dict[bytes, bytes],
    reason: bytes,
) -> None:
    client = _client(backend)
    client.xadd(Keys(prefix).replies(P), fields)
    rc = receiver_for(backend.connect(), rx_db, clock, prefix, P, "r1")
    assert drain(rc) == 0
    (dead,) = client.xrange(Keys(prefix).replies_dead(P))
    assert dead[1][b"dl.reason"] == reason
    assert effect_counts(rx_path) == {}
    assert rc.receipts.list() == []
    assert rc.reader.pending() == {}


def test_receiver_failing_effect_leaves_nothing_and_is_retried_then_dead_lettered(rx: _Rx) -> None:
    backend, agent_db, rx_db, rx_path, clock, prefix = rx
    ids = _publish(backend, agent_db, clock, prefix, 2)
    poison = ids[0]

    def effect(conn: sqlite3.Connection, reply: Reply) -> Any:
        record_effect(conn, reply)  # written, then rolled back with its savepoint
        if reply.reply_id == poison:
            raise RuntimeError("downstream table full")
        return None

    config = ReceiverConfig(
        prefix=prefix, principal=P, consumer="r1", block_ms=20, max_deliveries=3
    )
    rc = Receiver(
        config,
        backend.connect(),
        ReceiptStore(rx_db, clock),
        effect,
        keyring=reply_keyring(),
    )
    for _ in range(10):
        rc.step()
        clock.advance(config.failed_step_pause_s)  # each retry waits for the pause
    assert effect_counts(rx_path) == {ids[1]: 1}
    assert rc.receipts.get(poison) is None
    assert rc.stats.effect_failures == 3
    (dead,) = _client(backend).xrange(Keys(prefix).replies_dead(P))
    assert dead[1][b"dl.reason"] == b"delivery_limit"
    assert rc.reader.pending() == {}


def test_receiver_takes_over_entries_of_a_dead_consumer(rx: _Rx) -> None:
    backend, agent_db, rx_db, rx_path, clock, prefix = rx
    ids = _publish(backend, agent_db, clock, prefix, 3)
    client = _client(backend)
    stream = Keys(prefix).replies(P)
    client.xgroup_create(stream, RECEIVER_GROUP, id="0")
    client.xreadgroup(RECEIVER_GROUP, "dead-one", {stream: ">"})  # read, never applied
    heir = receiver_for(backend.connect(), rx_db, clock, prefix, P, "heir", claim_min_idle_ms=0)
    assert drain(heir) == 3
    assert heir.reader.stats.taken_over == 3
    assert effect_counts(rx_path) == dict.fromkeys(ids, 1)
    assert heir.reader.pending() == {}


def test_receiver_config_refuses_socket_timeout_shorter_than_block(
    backend: Backend, rx_db: Database, prefix: str
) -> None:
    config = ReceiverConfig(prefix=prefix, principal=P, block_ms=5000)
    with pytest.raises(ConfigError):
        Receiver(
            config,
            backend.connect(socket_timeout_s=2),
            ReceiptStore(rx_db),
            keyring=reply_keyring(),
        )


def test_receiver_refuses_a_keyring_without_the_principals_keys(
    backend: Backend, rx_db: Database, prefix: str
) -> None:
    config = ReceiverConfig(prefix=prefix, principal="carol")
    with pytest.raises(ConfigError, match="no keys for principal 'carol'"):
        Receiver(config, backend.connect(), ReceiptStore(rx_db), keyring=reply_keyring())


def test_effect_key_is_stable_and_carries_the_fence() -> None:
    body = {"reply_id": "r-abc", "task_id": "abc", "fence": 3, "status": "done"}
    key = effect_key(Reply.from_mapping(body))
    assert key == effect_key(Reply.from_mapping(load_body(canonical_json(body))))
    assert (key.idempotency_key, key.task_id, key.fence) == ("ba-reply:r-abc", "abc", 3)


def test_receiver_run_applies_until_stopped(rx: _Rx) -> None:
    backend, agent_db, rx_db, rx_path, clock, prefix = rx
    ids = _publish(backend, agent_db, clock, prefix, 3)
    rc = receiver_for(backend.connect(), rx_db, clock, prefix, P, "r1")
    stop = threading.Event()
    worker = threading.Thread(target=rc.run, args=(stop,))
    worker.start()
    deadline = time.monotonic() + 10
    while rc.stats.applied < len(ids):  # poll the condition, with a timeout
        assert time.monotonic() < deadline, "run() did not apply everything"
    stop.set()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert effect_counts(rx_path) == dict.fromkeys(ids, 1)


def test_receiver_busy_store_holds_the_batch_and_spends_no_delivery_count(
    backend: Backend, agent_db: Database, tmp_path: Path, clock: FakeClock, prefix: str
) -> None:
    """A receipts database locked for longer than the delivery limit's worth of retries must
    not dead-letter good replies: the batch is retried as it is, not read again."""
    from broker_adapter.errors import StoreBusy

    ids = _publish(backend, agent_db, clock, prefix, 3)
    path = tmp_path / "busy-rx.db"
    db = Database(path, busy_timeout_ms=20)
    rc = receiver_for(backend.connect(), db, clock, prefix, P, "busy", max_deliveries=3)
    holder = sqlite3.connect(str(path), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # someone else holds the write lock
    failures = 0
    for _ in range(8):  # more failures than max_deliveries
        try:
            rc.step()
        except StoreBusy:
            failures += 1
    holder.execute("COMMIT")
    holder.close()
    assert failures >= 6  # the first steps may only replay the (empty) own pending list
    assert drain(rc) == 3
    assert effect_counts(path) == dict.fromkeys(ids, 1)
    assert _client(backend).xlen(Keys(prefix).replies_dead(P)) == 0
    assert rc.reader.pending() == {}
    db.close()


def test_receiver_reads_ahead_with_its_xack_and_a_stop_leaves_nothing_read_unapplied(
    rx: _Rx,
) -> None:
    backend, agent_db, rx_db, rx_path, clock, prefix = rx
    ids = _publish(backend, agent_db, clock, prefix, 6)
    rc = receiver_for(backend.connect(), rx_db, clock, prefix, P, "r1", count=2)
    assert rc.step() == 0  # the replay of its own (empty) pending list
    assert rc.step() == 2  # two applied and acked; the next two read in the XACK's trip
    assert rc.reader.pending() == {"r1": 2}
    assert rc.step() == 2  # those two from memory
    stop = threading.Event()
    stop.set()
    rc.run(stop)  # stopped at once: only what was read ahead is applied
    assert effect_counts(rx_path) == dict.fromkeys(ids, 1)
    assert rc.reader.pending() == {}
    assert rc.stats.applied == 6


def test_receiver_prefetch_left_by_a_batch_of_dead_letters_is_applied_on_stop(rx: _Rx) -> None:
    """After a whole batch the receiver sends the read of the next one at once
    (``GroupReader.prefetch``); a batch of dead letters acknowledges nothing, so the next
    read takes that reply, and a stop still applies it."""
    backend, agent_db, rx_db, rx_path, clock, prefix = rx
    client = _client(backend)
    for _ in range(2):
        client.xadd(Keys(prefix).replies(P), {b"v": b"1", b"reply_id": b"r-bad"})
    ids = _publish(backend, agent_db, clock, prefix, 2)
    rc = receiver_for(backend.connect(), rx_db, clock, prefix, P, "r1", count=2)
    assert rc.step() == 0  # the replay of its own (empty) pending list
    assert rc.step() == 0  # both dead-lettered; the next two read in the meantime
    assert rc.reader.has_ahead
    assert effect_counts(rx_path) == {}
    stop = threading.Event()
    stop.set()
    rc.run(stop)
    assert effect_counts(rx_path) == dict.fromkeys(ids, 1)
    assert rc.reader.pending() == {}
    assert len(client.xrange(Keys(prefix).replies_dead(P))) == 2
