"""docs/PROTOCOL.md is the contract: its vectors verify, and a publisher that uses only
redis-py, ``json``, ``hmac`` and ``hashlib`` (none of our code) gets its tasks ingested."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from pathlib import Path
from typing import Any

import pytest
import redis

from broker_adapter.clock import FakeClock
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.signing import Keyring, reply_signature
from broker_adapter.redis.client import connect
from broker_adapter.stages.ingest.config import IngestConfig
from broker_adapter.stages.ingest.ingest import Ingestor
from broker_adapter.stages.receiver.receiver import Receiver, ReceiverConfig, parse_entry
from broker_adapter.store import ReceiptStore, TaskStore, open_database
from tests.support.ingest_script import drain, task_counts
from tests.support.redis_server import RedisServer

PROTOCOL = Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"


def _block(marker: str) -> Any:
    """The JSON block between the ``<marker>:begin`` and ``<marker>:end`` comments."""
    text = PROTOCOL.read_text(encoding="utf-8")
    match = re.search(
        rf"<!-- {marker}:begin -->\s*```json\n(.*?)```\s*<!-- {marker}:end -->",
        text,
        re.DOTALL,
    )
    assert match is not None, f"PROTOCOL.md lost its {marker} block"
    return json.loads(match.group(1))


def load_vectors() -> list[dict[str, str]]:
    """The JSON block between the test-vector markers of PROTOCOL.md."""
    vectors: list[dict[str, str]] = _block("test-vectors")
    assert len(vectors) >= 3
    return vectors


def load_fingerprint_vectors() -> list[dict[str, Any]]:
    """The groups of envelopes that must fingerprint the same (section 4)."""
    groups: list[dict[str, Any]] = _block("fingerprint-vectors")
    assert len(groups) >= 3
    return groups


def load_reply_vectors() -> list[dict[str, str]]:
    """The JSON block between the reply-vector markers of PROTOCOL.md (section 11)."""
    text = PROTOCOL.read_text(encoding="utf-8")
    match = re.search(
        r"<!-- reply-vectors:begin -->\s*```json\n(.*?)```\s*<!-- reply-vectors:end -->",
        text,
        re.DOTALL,
    )
    assert match is not None, "PROTOCOL.md lost its reply-vector block"
    vectors: list[dict[str, str]] = json.loads(match.group(1))
    assert len(vectors) >= 3
    return vectors


def _keyring(vectors: list[dict[str, str]]) -> Keyring:
    keys: dict[str, dict[str, str]] = {}
    for v in vectors:
        keys.setdefault(v["principal"], {})[v["kid"]] = v["secret"]
    return Keyring(keys)


def _plain_sign(secret: bytes, kid: str, env: bytes) -> str:
    """The signature as PROTOCOL.md section 6 defines it, written out independently."""
    return hmac.new(
        secret, b"ba.v1\n" + kid.encode("ascii") + b"\n" + env, hashlib.sha256
    ).hexdigest()


def _plain_canonical(obj: Any) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


@pytest.mark.parametrize("vector", load_vectors(), ids=lambda v: v["name"])
def test_protocol_vector_verifies(vector: dict[str, str]) -> None:
    env = vector["env"].encode("utf-8")
    assert _plain_sign(vector["secret"].encode(), vector["kid"], env) == vector["sig"]
    # the vector is in canonical form, and our encoder produces exactly those bytes
    assert _plain_canonical(json.loads(env)) == env
    assert Envelope.from_json(env).to_json() == env
    fields = {
        b"v": b"1",
        b"env": env,
        b"kid": vector["kid"].encode(),
        b"sig": vector["sig"].encode(),
    }
    assert _keyring(load_vectors()).verify(fields) == vector["principal"]


@pytest.mark.parametrize("group", load_fingerprint_vectors(), ids=lambda g: g["name"])
def test_protocol_fingerprint_vectors_are_one_content(group: dict[str, Any]) -> None:
    content = group["content"].encode("utf-8")
    assert hashlib.sha256(content).hexdigest() == group["fingerprint"]
    for env in group["envs"]:
        assert Envelope.from_json(env).fingerprint() == group["fingerprint"], env
    # the deadline and max_attempts are content: changing either makes another request
    first = Envelope.from_json(group["envs"][0])
    for change in (
        {"deadline": first.deadline + 1},
        {"deadline": first.deadline - 0.5},
        {"max_attempts": first.max_attempts % 10 + 1},
    ):
        assert first.replace(**change).fingerprint() != group["fingerprint"], change
    assert first.replace(hops=first.hops + 1).fingerprint() == group["fingerprint"]


def test_protocol_vector_secrets_are_long_enough() -> None:
    assert all(len(v["secret"].encode()) >= 32 for v in load_vectors())


def _plain_reply_sign(secret: bytes, kid: str, principal: str, reply_id: str, body: bytes) -> str:
    """The reply signature as PROTOCOL.md section 11 defines it, written out independently."""
    msg = b"ba.reply.v1\n" + "\n".join((kid, principal, reply_id)).encode() + b"\n" + body
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def _reply_fields(vector: dict[str, str]) -> dict[bytes, bytes]:
    body = vector["body"].encode("utf-8")
    return {
        b"v": b"2",
        b"reply_id": vector["reply_id"].encode(),
        b"hash": hashlib.sha256(body).hexdigest().encode(),
        b"body": body,
        b"kid": vector["kid"].encode(),
        b"sig": vector["sig"].encode(),
    }


@pytest.mark.parametrize("vector", load_reply_vectors(), ids=lambda v: v["name"])
def test_protocol_reply_vector_verifies(vector: dict[str, str]) -> None:
    body = vector["body"].encode("utf-8")
    secret, kid, principal = vector["secret"].encode(), vector["kid"], vector["principal"]
    assert len(secret) >= 32
    assert _plain_reply_sign(secret, kid, principal, vector["reply_id"], body) == vector["sig"]
    ring = _keyring(load_reply_vectors())
    assert reply_signature(secret, kid, principal, vector["reply_id"], body) == vector["sig"]
    assert (
        ring.verify_reply(principal, vector["reply_id"], body, kid.encode(), vector["sig"].encode())
        == kid
    )
    item = parse_entry(_reply_fields(vector), principal, "1-0", keyring=ring)
    assert (item.reply_id, item.principal, item.body) == (vector["reply_id"], principal, body)
    # the same bytes under the request domain are another signature
    assert _plain_sign(secret, kid, body) != vector["sig"]


@pytest.mark.integration
def test_protocol_reply_vectors_written_by_a_plain_client_are_applied(
    redis_server: RedisServer, prefix: str, tmp_path: Path, clock: FakeClock
) -> None:
    vectors = load_reply_vectors()
    raw = redis.Redis(port=redis_server.port)
    stream = f"{prefix}:{{out.alice}}:replies"  # spelled out from the doc
    assert stream == Keys(prefix).replies("alice")
    for v in vectors:
        raw.xadd(stream, _reply_fields(v))  # type: ignore[arg-type]
    config = ReceiverConfig(prefix=prefix, principal="alice", consumer="vectors", block_ms=20)
    receipts = ReceiptStore(open_database(tmp_path / "rx.db"), clock)
    receiver = Receiver(
        config, connect(redis_server.url), receipts, keyring=_keyring(vectors), clock=clock
    )
    for _ in range(5):
        receiver.step()
    assert sorted(r.reply_id for r in receipts.list()) == sorted(v["reply_id"] for v in vectors)
    assert raw.xlen(Keys(prefix).replies_dead("alice")) == 0
    raw.close()


@pytest.mark.integration
def test_protocol_plain_redis_publisher_is_ingested(
    redis_server: RedisServer, prefix: str, tmp_path: Path, clock: FakeClock
) -> None:
    # requests only: the cancel vector (section 12) is checked by test_client_cancel
    vectors = [v for v in load_vectors() if json.loads(v["env"])["kind"] != "cancel"]
    raw = redis.Redis(port=redis_server.port)  # a plain client, as a foreign agent would use
    stream = f"{prefix}:{{in}}:tasks"  # spelled out from the doc, not taken from keys.py
    assert stream == Keys(prefix).inbound()
    for v in vectors:
        raw.xadd(stream, {"v": "1", "env": v["env"].encode(), "kid": v["kid"], "sig": v["sig"]})
    # a fresh envelope, encoded and signed with the standard library only
    alice_secret = next(v["secret"] for v in vectors if v["kid"] == "alice-2026").encode()
    envelope = {
        "message_id": "plain-1",
        "sender": "alice",
        "payload": {"city": "Zürich", "temps": [1.5, -2]},
        "deadline": 1_900_000_000,
        "max_attempts": 2,
    }
    env = _plain_canonical(envelope)
    raw.xadd(
        stream,
        {
            "v": "1",
            "env": env,
            "kid": "alice-2026",
            "sig": _plain_sign(alice_secret, "alice-2026", env),
        },
    )

    client = connect(redis_server.url)
    clock.set(1_900_000_000 - 3600)  # the vectors' deadlines are within the window from here
    tasks = TaskStore(open_database(tmp_path / "inbox.db"), clock)
    config = IngestConfig(prefix=prefix, consumer="ingest-t-0", block_ms=20)
    ingestor = Ingestor(config, client, tasks, _keyring(vectors), clock=clock)
    drain(ingestor, client)

    expected = {(v["principal"], json.loads(v["env"])["message_id"]) for v in vectors}
    expected.add(("alice", "plain-1"))
    assert task_counts(tasks) == dict.fromkeys(expected, 1)
    assert raw.xlen(Keys(prefix).inbound_dead()) == 0
    row = tasks.find("alice", "plain-1")
    assert row is not None
    assert (row.max_attempts, row.deadline) == (2, 1_900_000_000.0)
    # a vector's trace context is kept with its task (and so goes into its reply)
    traced = {c.message_id: c.traceparent for c in tasks.claim("w", len(expected))}
    for v in vectors:
        sent = json.loads(v["env"])
        assert traced[sent["message_id"]] == sent.get("traceparent")
    assert any(tp is not None for tp in traced.values())
    raw.close()


def test_protocol_section_12_derived_ids() -> None:
    """The derived message ids of section 12 are what the client computes."""
    from broker_adapter.client.request import cancel_message_id, message_id_for

    text = PROTOCOL.read_text(encoding="utf-8")
    derived = message_id_for("alice", "host-1", "restart-web-incident-42")
    assert f"give `{derived}`" in text
    assert cancel_message_id("order-42") in text
