"""Hostile entries against a real redis-server: no entry, however wide, large, repeated,
deeply nested or oddly encoded, stops the ingest or the receiver, and the legitimate work
read with it or behind it is still done.

Each entry ends as ONE dead letter with its reason; the dead-letter script never gets an
unbounded argument list, every text taken from input is escaped before Redis sees it, and an
exception while handling one entry dead-letters that entry (``internal_error``), not the
batch."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.client.publisher import Publisher
from broker_adapter.clock import FakeClock
from broker_adapter.protocol import deadletter
from broker_adapter.protocol.canonical import canonical_json, sha256_hex
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import INGEST_GROUP, Keys
from broker_adapter.protocol.reply import Reply
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect, text
from broker_adapter.redis.internals import exchange
from broker_adapter.stages.ingest.config import IngestConfig
from broker_adapter.stages.ingest.ingest import Ingestor
from broker_adapter.stages.receiver import receiver as receiver_module
from broker_adapter.stages.receiver.receiver import Receiver, ReceiverConfig
from broker_adapter.store import ReceiptStore, TaskStore, open_database
from broker_adapter.store.db import Database
from tests.support.cli import cli_env, count_rows
from tests.support.ingest_script import age_pending, drain, task_counts, xadd_signed
from tests.support.redis_server import RedisServer
from tests.support.replies_script import (
    dispatcher_for,
    effect_counts,
    make_replies,
    receiver_for,
    record_effect,
    reply_keyring,
)
from tests.support.replies_script import drain as drain_receiver

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SECRETS = {"alice": {"k1": "alice: a test secret of more than thirty-two bytes"}}
P = "alice"
WIDE = [4_000, 10_000]  # Lua unpacks at most 7,998 values: both were beyond the old script


@pytest.fixture
def keyring() -> Keyring:
    return Keyring(SECRETS)


@pytest.fixture
def tasks(tmp_path: Path, clock: FakeClock) -> Iterator[TaskStore]:
    db = open_database(tmp_path / "inbox.db")
    yield TaskStore(db, clock)
    db.close()


def _envelope(message_id: str, deadline: float) -> Envelope:
    return Envelope.build(
        message_id=message_id, sender=P, payload={"n": message_id}, deadline=deadline
    )


def _xadd(client: Any, stream: str, pairs: list[bytes]) -> str:
    """XADD the name/value ``pairs`` as they are (repeated names too)."""
    return text(client.execute_command("XADD", stream, "*", *pairs))


def _wide(n: int) -> list[bytes]:
    """An entry of ``n`` one-byte fields (``redis-cli XADD s '*' f0 x f1 x ...``)."""
    return [item for i in range(n) for item in (f"f{i}".encode(), b"x")]


def _dead(client: Any, stream: str) -> dict[str, list[tuple[bytes, bytes]]]:
    """The dead letters of ``stream`` by the entry id they came from, as raw pairs."""
    out: dict[str, list[tuple[bytes, bytes]]] = {}
    ((entries),) = exchange(client, [("XRANGE", stream, "-", "+")], raw=True)
    for _, raw in entries:
        pairs = list(zip(raw[::2], raw[1::2], strict=True))
        out[text(dict(pairs)[b"dl.entry_id"])] = pairs
    return out


def _note(pairs: list[tuple[bytes, bytes]], name: bytes) -> bytes:
    return dict(pairs)[name]


def _copied(pairs: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in pairs if k.startswith(b"orig.")]


def _ingestor(
    client: Any, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock, **cfg: Any
) -> Ingestor:
    config = IngestConfig(prefix=prefix, consumer="ingest-h-0", block_ms=20, **cfg)
    return Ingestor(config, client, tasks, keyring, clock=clock)


def _surrogate_env(deadline: float) -> bytes:
    """An envelope whose unknown member is named by a lone surrogate (``json`` decodes the
    escape; the name cannot be encoded as UTF-8)."""
    return (
        b'{"\\ud800": 1, "message_id": "s", "sender": "alice", "payload": {}, '
        b'"deadline": ' + str(deadline).encode() + b"}"
    )


# -- the ingest --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", WIDE)
@pytest.mark.parametrize("path", ["step", "take_over", "delivery_limit"])
def test_ingest_wide_entry_is_dead_lettered_and_the_request_behind_it_stored(
    redis_server: RedisServer,
    prefix: str,
    tasks: TaskStore,
    keyring: Keyring,
    clock: FakeClock,
    n: int,
    path: str,
) -> None:
    client: Any = connect(redis_server.url)
    keys = Keys(prefix)
    wide = _xadd(client, keys.inbound(), _wide(n))
    Publisher(client, keys, P, keyring).publish(_envelope("behind", clock.now() + 3600))
    ingestor = _ingestor(client, prefix, tasks, keyring, clock, max_deliveries=3)
    if path != "step":  # a dead consumer read it first
        client.xgroup_create(keys.inbound(), INGEST_GROUP, id="0")
        client.xreadgroup(INGEST_GROUP, "dead-one", {keys.inbound(): ">"}, count=1)
        if path == "delivery_limit":
            client.xclaim(
                keys.inbound(), INGEST_GROUP, "dead-one", 0, [wide], retrycount=9, justid=True
            )
        age_pending(client, keys.inbound(), "dead-one")
        ingestor.take_over()
    drain(ingestor, client)
    dead = _dead(client, keys.inbound_dead())
    reason = b"delivery_limit" if path == "delivery_limit" else b"too_many_fields"
    assert list(dead) == [wide]
    assert _note(dead[wide], b"dl.reason") == reason
    copied = _copied(dead[wide])
    assert copied == [(f"orig.f{i}".encode(), b"x") for i in range(64)]  # the first 64
    assert _note(dead[wide], b"dl.truncated").startswith(f"copied 64 of {n} fields".encode())
    assert task_counts(tasks) == {(P, "behind"): 1}
    assert client.xpending(keys.inbound(), INGEST_GROUP)["pending"] == 0


def test_ingest_repeated_field_names_are_refused_with_every_pair_kept(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    """redis-py's dict would keep the last ``env`` only; the reader refuses the entry and the
    dead letter keeps both, in order."""
    client: Any = connect(redis_server.url)
    keys = Keys(prefix)
    first = keyring.sign(_envelope("first", clock.now() + 3600))
    second = keyring.sign(_envelope("second", clock.now() + 3600))
    pairs = [
        b"v",
        b"1",
        b"env",
        first["env"],
        b"kid",
        b"k1",
        b"sig",
        first["sig"],
        b"env",
        second["env"],
        b"sig",
        second["sig"],
    ]
    dup = _xadd(client, keys.inbound(), pairs)
    Publisher(client, keys, P, keyring).publish(_envelope("good", clock.now() + 3600))
    ingestor = _ingestor(client, prefix, tasks, keyring, clock)
    drain(ingestor, client)
    dead = _dead(client, keys.inbound_dead())
    assert list(dead) == [dup]
    assert _note(dead[dup], b"dl.reason") == b"duplicate_field"
    assert _note(dead[dup], b"dl.field") == b"env"
    assert _copied(dead[dup]) == [
        (b"orig." + k, v) for k, v in zip(pairs[::2], pairs[1::2], strict=True)
    ]
    assert task_counts(tasks) == {(P, "good"): 1}
    assert ingestor.stats.dead_lettered == {"duplicate_field": 1}


def test_ingest_surrogate_member_name_is_escaped_and_its_batch_still_stored(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    client: Any = connect(redis_server.url)
    keys = Keys(prefix)
    pub = Publisher(client, keys, P, keyring)
    pub.publish(_envelope("before", clock.now() + 3600))
    bad = _xadd(
        client,
        keys.inbound(),
        [b"v", b"1", b"env", _surrogate_env(clock.now() + 3600), b"kid", b"k1", b"sig", b"00"],
    )
    pub.publish(_envelope("after", clock.now() + 3600))
    ingestor = _ingestor(client, prefix, tasks, keyring, clock)  # one batch: all three
    drain(ingestor, client)
    dead = _dead(client, keys.inbound_dead())
    assert list(dead) == [bad]
    assert _note(dead[bad], b"dl.reason") == b"unknown_field"
    assert _note(dead[bad], b"dl.field") == b"\\ud800"  # escaped, not dropped
    assert task_counts(tasks) == {(P, "before"): 1, (P, "after"): 1}


def test_ingest_oversize_entry_is_dead_lettered_with_a_bounded_copy(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    client: Any = connect(redis_server.url)
    keys = Keys(prefix)
    big = _xadd(client, keys.inbound(), [b"v", b"1", b"env", b"x" * 3_000_000])
    Publisher(client, keys, P, keyring).publish(_envelope("good", clock.now() + 3600))
    ingestor = _ingestor(client, prefix, tasks, keyring, clock, max_entry_bytes=100_000)
    drain(ingestor, client)
    dead = _dead(client, keys.inbound_dead())
    assert _note(dead[big], b"dl.reason") == b"oversize"
    copied = _copied(dead[big])
    # an entry nobody authenticated: a prefix of UNTRUSTED_COPY_BYTES (< max_entry_bytes)
    bound = deadletter.UNTRUSTED_COPY_BYTES
    assert sum(len(k) - len(b"orig.") + len(v) for k, v in copied) == bound
    assert copied[0] == (b"orig.v", b"1")
    truncated = _note(dead[big], b"dl.truncated")
    assert truncated.startswith(f"copied 2 of 2 fields, {bound} of".encode())
    assert task_counts(tasks) == {(P, "good"): 1}


def test_ingest_exception_while_checking_one_entry_dead_letters_only_that_entry(
    redis_server: RedisServer,
    prefix: str,
    tasks: TaskStore,
    keyring: Keyring,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client: Any = connect(redis_server.url)
    keys = Keys(prefix)
    ids = {
        m: xadd_signed(client, keys, keyring, _envelope(m, clock.now() + 3600))
        for m in ("a", "boom", "b")
    }
    real = Keyring.authenticate

    def authenticate(self: Keyring, fields: Any) -> Any:
        if b'"boom"' in fields[b"env"]:
            raise KeyError("a bug no check foresaw")
        return real(self, fields)

    monkeypatch.setattr(Keyring, "authenticate", authenticate)
    ingestor = _ingestor(client, prefix, tasks, keyring, clock)
    drain(ingestor, client)
    dead = _dead(client, keys.inbound_dead())
    assert list(dead) == [ids["boom"]]
    assert _note(dead[ids["boom"]], b"dl.reason") == b"internal_error"
    assert b"KeyError" in _note(dead[ids["boom"]], b"dl.detail")
    assert len(_copied(dead[ids["boom"]])) == 4  # the original is kept for a replay
    assert task_counts(tasks) == {(P, "a"): 1, (P, "b"): 1}


def test_ingest_failing_dead_letter_falls_back_to_a_minimal_one(
    redis_server: RedisServer,
    prefix: str,
    tasks: TaskStore,
    keyring: Keyring,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client: Any = connect(redis_server.url)
    keys = Keys(prefix)
    bad = _xadd(
        client, keys.inbound(), [b"v", b"1", b"env", b"{not json", b"kid", b"k1", b"sig", b"00"]
    )
    Publisher(client, keys, P, keyring).publish(_envelope("good", clock.now() + 3600))

    def broken_copy(original: Any, **limits: Any) -> Any:
        raise MemoryError("copying the fields failed")

    monkeypatch.setattr(deadletter, "copy_original", broken_copy)
    ingestor = _ingestor(client, prefix, tasks, keyring, clock)
    drain(ingestor, client)
    (pairs,) = _dead(client, keys.inbound_dead()).values()
    notes = dict(pairs)
    assert notes[b"dl.reason"] == b"internal_error"
    assert notes[b"dl.failed_reason"] == b"unparseable"
    assert notes[b"dl.entry_id"] == bad.encode()
    assert b"MemoryError" in notes[b"dl.detail"]
    assert _copied(pairs) == []
    assert task_counts(tasks) == {(P, "good"): 1}


def test_ingest_with_no_dead_letter_possible_acknowledges_the_entry_and_goes_on(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    """A neighbour made the dead-letter stream a string: no dead letter can be written. The
    bad entry is acknowledged with an alarm (it stays in the stream), the good one stored."""
    client: Any = connect(redis_server.url)
    keys = Keys(prefix)
    client.set(keys.inbound_dead(), "not a stream")
    _xadd(client, keys.inbound(), [b"v", b"1", b"env", b"{not json", b"kid", b"k1", b"sig", b"0"])
    Publisher(client, keys, P, keyring).publish(_envelope("good", clock.now() + 3600))
    ingestor = _ingestor(client, prefix, tasks, keyring, clock)
    drain(ingestor, client)
    assert task_counts(tasks) == {(P, "good"): 1}
    assert ingestor.readers[0].stats.dead_letter_failures == 1
    assert client.xlen(keys.inbound()) == 2
    assert client.xpending(keys.inbound(), INGEST_GROUP)["pending"] == 0


# -- the runner, through the CLI ---------------------------------------------------------------


def test_cli_run_survives_hostile_entries_and_answers_the_requests_behind_them(
    redis_server: RedisServer, tmp_path: Path, prefix: str
) -> None:
    """The entries that stopped the runner for good: 4,000 and 10,000 fields (the old
    dead-letter script failed in Lua), a surrogate member name (redis-py could not encode its
    dead letter), a repeated field name. Each is dead-lettered once, the runner keeps
    running, and the valid requests published behind them are answered."""
    keyring_path = tmp_path / "keyring.json"
    keyring_path.write_text(json.dumps(SECRETS))
    keyring_path.chmod(0o600)
    keyring = Keyring.load(keyring_path)
    client: Any = redis_server.client()
    keys = Keys(prefix)
    deadline = time.time() + 3600
    surrogate = [b"v", b"1", b"env", _surrogate_env(deadline), b"kid", b"k1", b"sig", b"00"]
    bad = [
        _xadd(client, keys.inbound(), _wide(4_000)),
        _xadd(client, keys.inbound(), _wide(10_000)),
        _xadd(client, keys.inbound(), surrogate),
        _xadd(client, keys.inbound(), [b"v", b"1", b"env", b"{}", b"env", b"{}"]),
    ]
    pub = Publisher(client, keys, P, keyring)
    for i in range(3):
        pub.publish(_envelope(f"m{i}", deadline))
    db = tmp_path / "adapter.db"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "run",
            "--redis",
            redis_server.url,
            "--db",
            str(db),
            "--handler",
            "broker_adapter.examples:echo",
            "--workers",
            "1",
            "--keyring",
            str(keyring_path),
            "--prefix",
            prefix,
            "--lease",
            "2",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(),
    )
    try:
        limit = time.monotonic() + 60
        while count_rows(db, "SELECT count(*) FROM outbox WHERE state = 'sent'") < 3:
            assert proc.poll() is None, "the runner stopped"
            assert time.monotonic() < limit, "the requests were not answered"
            time.sleep(0.05)  # polling a condition with an explicit timeout
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if proc.stdout:
            proc.stdout.close()
    dead = _dead(client, keys.inbound_dead())
    assert sorted(dead) == sorted(bad)
    reasons = [_note(dead[eid], b"dl.reason") for eid in bad]
    assert reasons == [b"too_many_fields", b"too_many_fields", b"unknown_field", b"duplicate_field"]
    assert client.xpending(keys.inbound(), INGEST_GROUP)["pending"] == 0
    client.close()


# -- the receiver ------------------------------------------------------------------------------


def _reply_pairs(reply_id: str, body: bytes) -> list[bytes]:
    """A reply entry signed as the adapter signs it: only its body is hostile."""
    signed = reply_keyring().sign_reply(P, reply_id, body)
    return [
        b"v",
        b"2",
        b"reply_id",
        reply_id.encode(),
        b"hash",
        sha256_hex(body).encode(),
        b"body",
        body,
        b"kid",
        signed.kid.encode(),
        b"sig",
        signed.sig.encode(),
    ]


def _body(reply_id: str) -> bytes:
    return canonical_json({"reply_id": reply_id, "principal": P, "status": "done"})


def _legit(
    server: RedisServer, agent_db: Database, clock: FakeClock, prefix: str, n: int, first: int
) -> list[str]:
    ids = make_replies(agent_db, clock, P, n, first=first)
    assert dispatcher_for(server.url, agent_db, clock, prefix, "d1").step() == n
    return ids


def _hostile_reply(kind: str) -> list[bytes]:
    if kind.startswith("wide"):
        return _wide(int(kind.removeprefix("wide-")))
    if kind == "deep":  # 10,000 levels: RecursionError in the old parse
        body = b'{"reply_id":"r-deep","principal":"alice","x":' + b"[" * 10_000 + b"]" * 10_000
        return _reply_pairs("r-deep", body + b"}")
    if kind == "nan":
        return _reply_pairs("r-nan", b'{"principal":"alice","reply_id":"r-nan","x":NaN}')
    if kind == "duplicate_key":
        body = b'{"principal":"alice","reply_id":"r-dup","status":"done","status":"failed"}'
        return _reply_pairs("r-dup", body)
    if kind == "duplicate_field":
        body = _body("r-df")
        return [*_reply_pairs("r-df", body), b"body", body]
    raise AssertionError(kind)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("wide-4000", b"too_many_fields"),
        ("wide-10000", b"too_many_fields"),
        ("deep", b"bad_reply"),
        ("nan", b"bad_reply"),
        ("duplicate_key", b"bad_reply"),
        ("duplicate_field", b"duplicate_field"),
    ],
)
def test_receiver_hostile_reply_is_dead_lettered_and_its_batch_applied(
    redis_server: RedisServer,
    agent_db: Database,
    rx_db: Database,
    tmp_path: Path,
    clock: FakeClock,
    prefix: str,
    kind: str,
    reason: bytes,
) -> None:
    client: Any = redis_server.client()
    keys = Keys(prefix)
    ids = _legit(redis_server, agent_db, clock, prefix, 2, 0)
    bad = _xadd(client, keys.replies(P), _hostile_reply(kind))
    ids += _legit(redis_server, agent_db, clock, prefix, 2, 2)  # behind it
    rc = receiver_for(redis_server.url, rx_db, clock, prefix, P, "r1")  # one batch of five
    assert drain_receiver(rc) == 4
    assert effect_counts(tmp_path / "receiver.db") == dict.fromkeys(ids, 1)
    dead = _dead(client, keys.replies_dead(P))
    assert list(dead) == [bad]
    assert _note(dead[bad], b"dl.reason") == reason
    assert rc.reader.pending() == {}
    client.close()


def test_receiver_64_mb_reply_is_dead_lettered_unhashed_and_its_batch_applied(
    redis_server: RedisServer,
    agent_db: Database,
    rx_db: Database,
    tmp_path: Path,
    clock: FakeClock,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client: Any = redis_server.client()
    keys = Keys(prefix)
    ids = _legit(redis_server, agent_db, clock, prefix, 1, 0)
    body = b'{"reply_id":"r-big","principal":"alice","x":"' + b"x" * (64 << 20) + b'"}'
    bad = _xadd(client, keys.replies(P), _reply_pairs("r-big", body))
    del body
    ids += _legit(redis_server, agent_db, clock, prefix, 1, 1)
    hashed: list[int] = []
    real_hash = sha256_hex

    def counting_hash(data: bytes) -> str:
        hashed.append(len(data))
        return real_hash(data)

    monkeypatch.setattr(receiver_module, "sha256_hex", counting_hash)
    try:
        rc = receiver_for(redis_server.url, rx_db, clock, prefix, P, "r1")
        assert drain_receiver(rc) == 2
        assert effect_counts(tmp_path / "receiver.db") == dict.fromkeys(ids, 1)
        assert max(hashed) < 1 << 20  # the big body was never hashed (nor parsed)
        dead = _dead(client, keys.replies_dead(P))
        assert _note(dead[bad], b"dl.reason") == b"oversize"
        copied = _copied(dead[bad])
        assert sum(len(v) for _, v in copied) <= rc.config.max_reply_bytes
        assert b"dl.truncated" in dict(dead[bad])
    finally:
        client.delete(keys.replies(P), keys.replies_dead(P))  # 64 MB off the shared server
        client.close()


def test_receiver_exception_while_checking_one_reply_dead_letters_only_that_reply(
    redis_server: RedisServer,
    agent_db: Database,
    rx_db: Database,
    tmp_path: Path,
    clock: FakeClock,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client: Any = redis_server.client()
    keys = Keys(prefix)
    ids = _legit(redis_server, agent_db, clock, prefix, 3, 0)
    real = receiver_module.parse_entry

    def parse_entry(fields: Any, principal: str, entry_id: str, **kwargs: Any) -> Any:
        if fields[b"reply_id"].decode() == ids[1]:
            raise ZeroDivisionError("a bug no check foresaw")
        return real(fields, principal, entry_id, **kwargs)

    monkeypatch.setattr(receiver_module, "parse_entry", parse_entry)
    rc = receiver_for(redis_server.url, rx_db, clock, prefix, P, "r1")
    assert drain_receiver(rc) == 2
    assert effect_counts(tmp_path / "receiver.db") == {ids[0]: 1, ids[2]: 1}
    (pairs,) = _dead(client, keys.replies_dead(P)).values()
    assert _note(pairs, b"dl.reason") == b"internal_error"
    assert b"ZeroDivisionError" in _note(pairs, b"dl.detail")
    assert rc.reader.pending() == {}
    client.close()


def test_receiver_retries_of_a_failing_effect_are_spaced_by_the_pause(
    redis_server: RedisServer,
    agent_db: Database,
    rx_db: Database,
    tmp_path: Path,
    clock: FakeClock,
    prefix: str,
) -> None:
    (poison,) = _legit(redis_server, agent_db, clock, prefix, 1, 0)

    def effect(conn: sqlite3.Connection, reply: Reply) -> Any:
        if reply.reply_id == poison:
            raise RuntimeError("downstream table full")
        return record_effect(conn, reply)

    config = ReceiverConfig(
        prefix=prefix,
        principal=P,
        consumer="r1",
        block_ms=20,
        max_deliveries=3,
        failed_step_pause_s=5.0,
    )
    rc = Receiver(
        config,
        connect(redis_server.url),
        ReceiptStore(rx_db, clock),
        effect,
        keyring=reply_keyring(),
    )
    for _ in range(3):
        rc.step()
    assert rc.stats.effect_failures == 1
    later = _legit(redis_server, agent_db, clock, prefix, 1, 1)
    for _ in range(10):  # no time passes: no retry, but new replies are applied meanwhile
        rc.step()
    assert rc.stats.effect_failures == 1
    assert effect_counts(tmp_path / "receiver.db") == dict.fromkeys(later, 1)
    clock.advance(4.9)
    rc.step()
    assert rc.stats.effect_failures == 1
    for expected in (2, 3):
        clock.advance(0.1 if expected == 2 else 5.0)
        for _ in range(3):
            rc.step()
        assert rc.stats.effect_failures == expected
    clock.advance(5.0)
    for _ in range(3):
        rc.step()
    assert rc.stats.effect_failures == 3  # the fourth delivery is past the limit
    (dead,) = _dead(redis_server.client(), Keys(prefix).replies_dead(P)).values()
    assert _note(dead, b"dl.reason") == b"delivery_limit"
    assert rc.reader.pending() == {}


def test_receiver_config_takes_the_limits(prefix: str) -> None:
    config = ReceiverConfig(prefix=prefix, principal=P)
    assert config.max_reply_bytes == 1 << 20
    assert config.max_entry_fields == 64
    with pytest.raises(ValueError, match="max_entry_fields"):
        ReceiverConfig(prefix=prefix, principal=P, max_entry_fields=5_000)
    with pytest.raises(ValueError, match="max_entry_fields"):
        IngestConfig(prefix=prefix, consumer="c", max_entry_fields=2)
