"""Reply signing and verification, and who needs a keyring for it (pure Python, no Redis)."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

import pytest

from broker_adapter.app.adapter import Adapter
from broker_adapter.app.adapter_config import AdapterConfig
from broker_adapter.app.pool import WorkerPool
from broker_adapter.clock import FakeClock
from broker_adapter.errors import AuthError, ConfigError
from broker_adapter.protocol.reply import BadReply
from broker_adapter.protocol.signing import Keyring, ReplySignature, reply_signature, signature
from broker_adapter.redis.client import connect
from broker_adapter.stages.receiver.receiver import parse_entry
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.stages.worker.worker import Worker
from broker_adapter.store import TaskStore, open_database

KEYS = {
    "alice": {
        "a2": "alice reply key, current, 32 bytes or more",
        "a1": "alice reply key, the older one, 32+ bytes",
    },
    "bob": {"b1": "bob reply key, thirty-two bytes or longer"},
}
BODY = b'{"principal":"alice","reply_id":"r-1","status":"done"}'


@pytest.fixture
def ring() -> Keyring:
    return Keyring(KEYS)


def _fields(sig: ReplySignature, body: bytes = BODY) -> dict[bytes, bytes]:
    return {
        b"v": b"2",
        b"reply_id": b"r-1",
        b"hash": hashlib.sha256(body).hexdigest().encode(),
        b"body": body,
        b"kid": sig.kid.encode(),
        b"sig": sig.sig.encode(),
    }


def test_reply_signature_matches_independent_hmac() -> None:
    secret = KEYS["alice"]["a2"].encode()
    message = b"ba.reply.v1\na2\nalice\nr-1\n" + BODY
    expected = hmac.new(secret, message, hashlib.sha256).hexdigest()
    assert reply_signature(secret, "a2", "alice", "r-1", BODY) == expected


def test_sign_reply_uses_the_first_key_and_verifies_with_any(ring: Keyring) -> None:
    current = ring.sign_reply("alice", "r-1", BODY)
    assert current.kid == "a2"
    assert ring.verify_reply("alice", "r-1", BODY, b"a2", current.sig.encode()) == "a2"
    older = ring.sign_reply("alice", "r-1", BODY, kid="a1")  # before the rotation
    assert ring.verify_reply("alice", "r-1", BODY, b"a1", older.sig.encode()) == "a1"
    assert ring.sign_reply("alice", "r-1", BODY) == current  # deterministic


@pytest.mark.parametrize(
    ("principal", "reply_id", "body", "kid", "reason"),
    [
        ("alice", "r-1", BODY + b" ", b"a2", "bad_signature"),  # other body
        ("alice", "r-2", BODY, b"a2", "bad_signature"),  # other reply id
        ("bob", "r-1", BODY, b"b1", "bad_signature"),  # bob's stream, bob's key
        ("alice", "r-1", BODY, b"a1", "bad_signature"),  # the kid is inside the MAC
        ("alice", "r-1", BODY, b"b1", "unknown_key"),  # another principal's key id
        ("alice", "r-1", BODY, b"\xff", "unknown_key"),
        ("carol", "r-1", BODY, b"a2", "unknown_principal"),
    ],
)
def test_verify_reply_refuses_anything_it_was_not_signed_for(
    ring: Keyring, principal: str, reply_id: str, body: bytes, kid: bytes, reason: str
) -> None:
    sig = ring.sign_reply("alice", "r-1", BODY).sig.encode()
    with pytest.raises(AuthError) as info:
        ring.verify_reply(principal, reply_id, body, kid, sig)
    assert info.value.reason == reason


def test_request_signature_never_passes_as_a_reply_signature(ring: Keyring) -> None:
    secret = KEYS["alice"]["a2"].encode()
    request_sig = signature(secret, "a2", BODY)  # domain ba.v1, same key, same bytes
    with pytest.raises(AuthError) as info:
        ring.verify_reply("alice", "r-1", BODY, b"a2", request_sig.encode())
    assert info.value.reason == "bad_signature"
    assert request_sig != ring.sign_reply("alice", "r-1", BODY).sig


def test_reply_signed_with_another_principals_key_is_refused(ring: Keyring) -> None:
    bob_secret = KEYS["bob"]["b1"].encode()
    forged = ReplySignature("a2", reply_signature(bob_secret, "a2", "alice", "r-1", BODY))
    with pytest.raises(BadReply) as info:
        parse_entry(_fields(forged), "alice", "1-0", keyring=ring)
    assert info.value.reason == "bad_signature"


def test_parse_entry_checks_the_signature_before_the_body(ring: Keyring) -> None:
    good = ring.sign_reply("alice", "r-1", BODY)
    assert parse_entry(_fields(good), "alice", "1-0", keyring=ring).reply_id == "r-1"
    unsigned = {k: v for k, v in _fields(good).items() if k != b"sig"}
    with pytest.raises(BadReply) as info:
        parse_entry(unsigned, "alice", "1-0", keyring=ring)
    assert info.value.reason == "missing_field"
    # a body that is not even JSON: refused for its signature, never parsed
    junk = ReplySignature("a2", "0" * 64)
    with pytest.raises(BadReply) as info:
        parse_entry(_fields(junk, body=b"\xff{"), "alice", "1-0", keyring=ring)
    assert info.value.reason == "bad_signature"


# -- who must have a keyring --------------------------------------------------------------


def test_a_worker_that_publishes_needs_a_keyring(tmp_path: Path) -> None:
    config = WorkerConfig(owner="w1")
    client = connect("redis://127.0.0.1:1")
    with open_database(tmp_path / "w.db") as db:
        tasks = TaskStore(db, FakeClock(1000.0))
        with pytest.raises(ConfigError, match="keyring"):
            Worker(config, tasks, lambda task: {}, redis_client=client)
        worker = Worker(config, tasks, lambda task: {}, keyring=Keyring(KEYS), redis_client=client)
        assert worker.publisher is not None
        assert worker.publisher.keyring is not None
        assert Worker(WorkerConfig(owner="w2"), tasks, lambda task: {}).publisher is None


def test_a_pool_of_publishing_workers_needs_a_keyring(tmp_path: Path) -> None:
    def config(i: int) -> WorkerConfig:
        return WorkerConfig(owner=f"w{i}")

    with pytest.raises(ConfigError, match="keyring"):
        WorkerPool(
            1,
            tmp_path / "p.db",
            "broker_adapter.examples:echo",
            config,
            publish_url="redis://127.0.0.1:1",
        )


def _run_config(tmp_path: Path, keyring: Path | None, **over: object) -> AdapterConfig:
    return AdapterConfig(
        redis_url="redis://127.0.0.1:1",
        db_path=tmp_path / "a.db",
        handler="broker_adapter.examples:echo",
        keyring_path=keyring,
        **over,
    )


def test_acl_mode_needs_a_keyring_with_every_acl_principals_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="acl mode needs a keyring"):
        _run_config(tmp_path, None, ingest={"mode": "acl", "acl_principals": ("alice",)})
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"alice": {"a2": KEYS["alice"]["a2"]}}), encoding="utf-8")
    path.chmod(0o600)
    ok = _run_config(tmp_path, path, ingest={"mode": "acl", "acl_principals": ("alice",)})
    assert Adapter(ok).keyring.key_ids("alice") == ("a2",)
    missing = _run_config(
        tmp_path, path, ingest={"mode": "acl", "acl_principals": ("alice", "bob", "carol")}
    )
    with pytest.raises(ConfigError, match=r"no keys for ACL principal.*bob, carol"):
        Adapter(missing)
