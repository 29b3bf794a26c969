"""Signed replies against a real redis-server: whoever can write a reply stream cannot make
the receiver apply a reply the adapter did not sign, and every publish path signs.

The attacker here is any Redis client: it XADDs entries of its own to ``replies(P)``, with
invented reply ids, with the real reply id *before* the real reply is published, and with
the id of a conflict answer; with a key of its own, another principal's key, or a request
signature. Each is dead-lettered before any receipt is written, and the real replies are
still applied exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.errors import ConfigError
from broker_adapter.protocol.canonical import canonical_json, sha256_hex
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.signing import Keyring, reply_signature, signature
from broker_adapter.redis.client import connect
from broker_adapter.stages.dispatch.dispatcher import Dispatcher, DispatcherConfig
from broker_adapter.stages.dispatch.loss import LossEvent
from broker_adapter.stages.receiver.receiver import Receiver, ReceiverConfig
from broker_adapter.store import AcceptItem, OutboxStore, ReceiptStore, TaskStore
from broker_adapter.store.db import Database
from tests.support.redis_server import RedisServer
from tests.support.replies_script import (
    REPLY_KEYS,
    dispatcher_for,
    drain,
    effect_counts,
    make_replies,
    receiver_for,
    record_effect,
    reply_keyring,
)

pytestmark = pytest.mark.integration

P = "alice"
ALICE_KID = next(iter(REPLY_KEYS[P]))
ALICE_SECRET = REPLY_KEYS[P][ALICE_KID].encode()
BOB_KID = next(iter(REPLY_KEYS["bob"]))
BOB_SECRET = REPLY_KEYS["bob"][BOB_KID].encode()
ATTACKER_SECRET = b"a secret the attacker made up, 32+ bytes"


def _forged(
    reply_id: str,
    *,
    secret: bytes = ATTACKER_SECRET,
    kid: str = ALICE_KID,
    sign: Any = None,
) -> dict[bytes, bytes]:
    """A reply entry as an attacker would write it: a plausible ``done`` body for ``P``,
    signed with ``secret`` under ``kid`` (or by ``sign(body)``)."""
    made = FakeClock().now()  # the receivers' clock: within their window
    body = canonical_json(
        {
            "reply_id": reply_id,
            "principal": P,
            "status": "done",
            "result": {"forged": True},
            "finished_at": made,
        }
    )
    sig = sign(body) if sign else reply_signature(secret, kid, P, reply_id, body)
    return {
        b"v": b"2",
        b"reply_id": reply_id.encode(),
        b"hash": sha256_hex(body).encode(),
        b"body": body,
        b"kid": kid.encode(),
        b"sig": sig.encode(),
    }


def _conflict_answer(db: Database, clock: FakeClock) -> str:
    """Reuse ``m0`` with other content: the adapter writes a conflict answer; its id."""
    env = Envelope.build(
        message_id="m0", sender=P, payload={"i": "other"}, deadline=clock.now() + 86_400
    )
    (res,) = TaskStore(db, clock).accept([AcceptItem(P, env)])
    assert res.reply_id is not None
    assert res.reply_id.startswith("c-")
    return res.reply_id


def _dead_reasons(server: RedisServer, prefix: str) -> list[tuple[str, str]]:
    dead: Any = server.client().xrange(Keys(prefix).replies_dead(P))
    return [(f[b"orig.reply_id"].decode(), f[b"dl.reason"].decode()) for _, f in dead]


def test_forged_replies_published_first_are_refused_and_the_real_ones_applied_once(
    redis_server: RedisServer,
    agent_db: Database,
    rx_db: Database,
    rx_path: Path,
    clock: FakeClock,
    prefix: str,
) -> None:
    real = make_replies(agent_db, clock, P, 2)
    conflict = _conflict_answer(agent_db, clock)
    client: Any = redis_server.client()
    stream = Keys(prefix).replies(P)
    forgeries = [
        ("r-invented", _forged("r-invented")),  # an invented reply id
        (real[0], _forged(real[0])),  # the real reply id, ahead of the real reply
        (conflict, _forged(conflict)),  # the conflict answer's id, ahead of the answer
        (real[1], _forged(real[1], secret=BOB_SECRET)),  # another principal's secret
        (real[1], _forged(real[1], secret=BOB_SECRET, kid=BOB_KID)),  # ... and key id
    ]
    for _, fields in forgeries:
        client.xadd(stream, fields)
    rc = receiver_for(redis_server.url, rx_db, clock, prefix, P, "r1")
    assert drain(rc) == 0  # the forgeries arrive first: none is applied or recorded
    assert rc.receipts.list() == []
    assert effect_counts(rx_path) == {}

    assert dispatcher_for(redis_server.url, agent_db, clock, prefix, "d1").step() == 3
    assert drain(rc) == 3
    assert effect_counts(rx_path) == {real[0]: 1, real[1]: 1, conflict: 1}
    assert (rc.stats.applied, rc.stats.conflicts, rc.stats.bad) == (3, 0, len(forgeries))
    outbox = OutboxStore(agent_db, clock)
    for reply_id in [*real, conflict]:  # what was applied is what the adapter wrote
        receipt, row = rc.receipts.get(reply_id), outbox.get(reply_id)
        assert receipt is not None
        assert row is not None
        assert bytes(receipt.body) == bytes(row.body)
        assert "forged" not in json.dumps(json.loads(receipt.body))
    expected = [(rid, "bad_signature") for rid, _ in forgeries[:-1]] + [(real[1], "unknown_key")]
    assert _dead_reasons(redis_server, prefix) == expected
    assert rc.reader.pending() == {}


@pytest.mark.parametrize(
    ("sign", "reason"),
    [
        # a request signature (domain ba.v1) over the body, with alice's real key
        (lambda body: signature(ALICE_SECRET, ALICE_KID, body), "bad_signature"),
        # alice's real key, but signed for another stream (principal bob)
        (
            lambda body: reply_signature(ALICE_SECRET, ALICE_KID, "bob", "r-1", body),
            "bad_signature",
        ),
        # alice's real key, signed for another reply id
        (lambda body: reply_signature(ALICE_SECRET, ALICE_KID, P, "r-2", body), "bad_signature"),
        # the right signature, upper-case hex: not the form the protocol defines
        (
            lambda body: reply_signature(ALICE_SECRET, ALICE_KID, P, "r-1", body).upper(),
            "bad_signature",
        ),
        # the right signature: applied (the control case, so that the others can fail)
        (lambda body: reply_signature(ALICE_SECRET, ALICE_KID, P, "r-1", body), None),
    ],
    ids=["request-signature", "other-stream", "other-reply-id", "upper-hex", "genuine"],
)
def test_reply_signature_made_for_anything_else_is_refused(
    redis_server: RedisServer,
    rx_db: Database,
    rx_path: Path,
    clock: FakeClock,
    prefix: str,
    sign: Any,
    reason: str | None,
) -> None:
    client: Any = redis_server.client()
    client.xadd(Keys(prefix).replies(P), _forged("r-1", sign=sign))
    rc = receiver_for(redis_server.url, rx_db, clock, prefix, P, "r1")
    drain(rc)
    if reason is None:
        assert effect_counts(rx_path) == {"r-1": 1}
        assert _dead_reasons(redis_server, prefix) == []
    else:
        assert effect_counts(rx_path) == {}
        assert rc.receipts.list() == []
        assert _dead_reasons(redis_server, prefix) == [("r-1", reason)]


def test_key_rotation_old_key_verifies_and_a_resend_under_the_new_key_is_a_duplicate(
    redis_server: RedisServer,
    agent_db: Database,
    rx_db: Database,
    rx_path: Path,
    clock: FakeClock,
    prefix: str,
) -> None:
    old_kid = list(REPLY_KEYS[P])[1]
    before_rotation = Keyring({P: {old_kid: REPLY_KEYS[P][old_kid]}})
    ids = make_replies(agent_db, clock, P, 2)
    config = DispatcherConfig(prefix=prefix, owner="d-old")
    outbox = OutboxStore(agent_db, clock)
    client = connect(redis_server.url)
    assert Dispatcher(config, client, outbox, keyring=before_rotation).step() == 2
    rc = receiver_for(redis_server.url, rx_db, clock, prefix, P, "r1")  # knows both keys
    assert drain(rc) == 2
    assert effect_counts(rx_path) == dict.fromkeys(ids, 1)

    # rotated: the new key signs first. A resend finds the record: nothing is added ...
    rotated = Dispatcher(
        DispatcherConfig(prefix=prefix, owner="d-new"), client, outbox, keyring=reply_keyring()
    )
    assert outbox.requeue_sent(None) == 2
    assert rotated.step() == 2
    assert rotated.stats.already_published == 2
    raw: Any = redis_server.client()
    assert raw.xlen(Keys(prefix).replies(P)) == 2
    # ... and past the record's life a second entry, under the new key, is a duplicate
    raw.delete(*(Keys(prefix).reply_record(P, rid) for rid in ids))
    assert outbox.requeue_sent(None) == 2
    assert rotated.step() == 2
    kids = [f[b"kid"] for _, f in raw.xrange(Keys(prefix).replies(P))]
    assert kids == [old_kid.encode()] * 2 + [ALICE_KID.encode()] * 2
    assert drain(rc) == 2
    assert rc.stats.duplicates == 2
    assert effect_counts(rx_path) == dict.fromkeys(ids, 1)

    # once the old key is removed from the receiver's keyring, its entries are refused
    new_only = Keyring({P: {ALICE_KID: REPLY_KEYS[P][ALICE_KID]}})
    config_rx = ReceiverConfig(
        prefix=prefix, principal=P, consumer="r2", block_ms=20, group="fresh-group"
    )
    fresh = Receiver(
        config_rx,
        connect(redis_server.url),
        ReceiptStore(rx_db, clock),
        record_effect,
        keyring=new_only,
        clock=clock,
    )
    drain(fresh)
    assert [r for _, r in _dead_reasons(redis_server, prefix)] == ["unknown_key"] * 2


def test_every_publish_path_signs_wipe_resend_and_operator_replay(
    fresh_redis: RedisServer,
    agent_db: Database,
    rx_db: Database,
    rx_path: Path,
    clock: FakeClock,
    prefix: str,
) -> None:
    """The data-loss re-send and the operator's replay go through the signing publisher
    (the replay itself needs no keyring: it only puts the row back in line)."""
    ids = make_replies(agent_db, clock, P, 3)
    outbox = OutboxStore(agent_db, clock)
    (doomed,) = outbox.claim("x", 1)
    outbox.mark_dead(doomed.reply_id, "x", doomed.fence, "made dead for the test")
    d = dispatcher_for(fresh_redis.url, agent_db, clock, prefix, "d1")
    assert d.step() == 2
    fresh_redis.client().flushall()  # a wipe: the dispatcher re-sends what it had sent
    assert d.watch().event is LossEvent.WIPE
    assert d.step() == 2
    operator = Dispatcher(
        DispatcherConfig(prefix=prefix, owner="replay-op"),
        connect(fresh_redis.url),
        OutboxStore(agent_db, clock),
    )
    with pytest.raises(ConfigError, match="no keyring"):
        operator.claim()
    assert outbox.counts()["sending"] == 0  # it claimed nothing it could not publish
    operator.replay(doomed.reply_id, by="op")
    assert d.step() == 1
    entries: Any = fresh_redis.client().xrange(Keys(prefix).replies(P))
    assert len(entries) == 3
    assert all(f[b"v"] == b"2" and f[b"kid"] == ALICE_KID.encode() for _, f in entries)
    rc = receiver_for(fresh_redis.url, rx_db, clock, prefix, P, "r1")
    assert drain(rc) == 3
    assert effect_counts(rx_path) == dict.fromkeys(ids, 1)
    assert _dead_reasons(fresh_redis, prefix) == []


def test_a_reply_whose_principal_has_no_key_is_never_published_unsigned(
    redis_server: RedisServer, agent_db: Database, clock: FakeClock, prefix: str
) -> None:
    (rid,) = make_replies(agent_db, clock, "carol", 1)  # carol has no key in the keyring
    d = dispatcher_for(redis_server.url, agent_db, clock, prefix, "d1")
    assert d.step() == 0
    assert redis_server.client().exists(Keys(prefix).replies("carol")) == 0
    row = d.outbox.get(rid)
    assert row is not None
    assert row.state == "pending"  # back in line with backoff; dead past the budget
    assert "cannot sign" in (row.last_error or "")
