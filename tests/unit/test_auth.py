"""Keyring loading, signing and verification (pure Python, no Redis)."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.errors import AuthError, ConfigError, EnvelopeError
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.signing import (
    Keyring,
    check_stream_principal,
    signature,
    unsigned_fields,
)

KEYS = {
    "alice": {
        "a1": "alice-secret-1, a test key of 32+ bytes",
        "a2": "alice-secret-2, a test key of 32+ bytes",
    },
    "bob": {"b1": "bob-secret, a test key of 32+ bytes"},
}


def _env(sender: str = "alice", **over: Any) -> Envelope:
    fields: dict[str, Any] = {
        "message_id": "m-1",
        "sender": sender,
        "payload": {"q": "héllo"},
        "deadline": 1_900_000_000.0,
    }
    fields.update(over)
    return Envelope.build(**fields)


def _b(fields: dict[str, bytes]) -> dict[bytes, bytes]:
    return {k.encode(): v for k, v in fields.items()}


@pytest.fixture
def ring() -> Keyring:
    return Keyring(KEYS)


def test_signature_matches_independent_hmac() -> None:
    env = b'{"a":1}'
    expected = hmac.new(b"s3cret", b"ba.v1\nk1\n" + env, hashlib.sha256).hexdigest()
    assert signature(b"s3cret", "k1", env) == expected


def test_auth_sign_then_verify_returns_sender(ring: Keyring) -> None:
    fields = _b(ring.sign(_env()))
    assert fields[b"v"] == b"1"
    assert fields[b"kid"] == b"a1"  # the principal's first key by default
    assert ring.verify(fields) == "alice"
    auth = ring.authenticate(fields)
    assert auth.envelope == _env()
    assert auth.kid == "a1"


def test_auth_rotated_key_verifies(ring: Keyring) -> None:
    fields = _b(ring.sign(_env(), kid="a2"))
    assert fields[b"kid"] == b"a2"
    assert ring.verify(fields) == "alice"


@pytest.mark.parametrize("missing", [b"v", b"env", b"kid", b"sig"])
def test_auth_verify_missing_field(ring: Keyring, missing: bytes) -> None:
    fields = _b(ring.sign(_env()))
    del fields[missing]
    with pytest.raises(AuthError) as info:
        ring.verify(fields)
    assert info.value.reason == "missing_field"
    assert info.value.field == missing.decode()


def test_auth_verify_bad_version(ring: Keyring) -> None:
    fields = _b(ring.sign(_env()))
    fields[b"v"] = b"2"
    with pytest.raises(AuthError) as info:
        ring.verify(fields)
    assert info.value.reason == "bad_version"


def test_auth_verify_bad_signature_when_env_tampered(ring: Keyring) -> None:
    fields = _b(ring.sign(_env()))
    fields[b"env"] = _env(payload={"q": "other"}).to_json()
    with pytest.raises(AuthError) as info:
        ring.verify(fields)
    assert info.value.reason == "bad_signature"


@pytest.mark.parametrize("sig", [b"", b"00" * 32, b"zz", "é".encode() * 40])
def test_auth_verify_bad_signature_values(ring: Keyring, sig: bytes) -> None:
    fields = _b(ring.sign(_env()))
    fields[b"sig"] = sig
    with pytest.raises(AuthError) as info:
        ring.verify(fields)
    assert info.value.reason == "bad_signature"


def test_auth_verify_uppercase_hex_is_refused(ring: Keyring) -> None:
    fields = _b(ring.sign(_env()))
    fields[b"sig"] = fields[b"sig"].upper()
    with pytest.raises(AuthError) as info:
        ring.verify(fields)
    assert info.value.reason == "bad_signature"


def test_auth_verify_signature_bound_to_kid(ring: Keyring) -> None:
    fields = _b(ring.sign(_env(), kid="a1"))
    fields[b"kid"] = b"a2"  # same principal, other key: the MAC covers the kid
    with pytest.raises(AuthError) as info:
        ring.verify(fields)
    assert info.value.reason == "bad_signature"


def test_auth_verify_unknown_principal() -> None:
    ring = Keyring(KEYS)
    mallory = Keyring({"mallory": {"m1": "mallory's own secret of 32+ bytes"}})
    fields = _b(mallory.sign(_env("mallory")))
    with pytest.raises(AuthError) as info:
        ring.verify(fields)
    assert info.value.reason == "unknown_principal"


def test_auth_verify_unknown_key(ring: Keyring) -> None:
    fields = _b(ring.sign(_env()))
    fields[b"kid"] = b"a9"
    with pytest.raises(AuthError) as info:
        ring.verify(fields)
    assert info.value.reason == "unknown_key"


def test_auth_verify_non_ascii_kid_is_unknown_key(ring: Keyring) -> None:
    fields = _b(ring.sign(_env()))
    fields[b"kid"] = "ключ".encode()
    with pytest.raises(AuthError) as info:
        ring.verify(fields)
    assert info.value.reason == "unknown_key"


def test_auth_verify_spoofed_sender_is_sender_mismatch(ring: Keyring) -> None:
    # bob signs correctly with his own key but claims to be alice
    env = _env("alice").to_json()
    sig = signature(KEYS["bob"]["b1"].encode(), "b1", env).encode()
    fields = {b"v": b"1", b"env": env, b"kid": b"b1", b"sig": sig}
    with pytest.raises(AuthError) as info:
        ring.verify(fields)
    assert info.value.reason == "sender_mismatch"
    assert "bob" in info.value.detail


def test_auth_verify_spoof_with_forged_mac_is_not_mismatch(ring: Keyring) -> None:
    env = _env("alice").to_json()
    fields = {b"v": b"1", b"env": env, b"kid": b"b1", b"sig": b"ab" * 32}
    with pytest.raises(AuthError) as info:
        ring.verify(fields)
    assert info.value.reason == "unknown_key"


def test_auth_verify_invalid_envelope_raises_envelope_error(ring: Keyring) -> None:
    env = b'{"sender":"alice"}'
    fields = {b"v": b"1", b"env": env, b"kid": b"a1"}
    fields[b"sig"] = signature(KEYS["alice"]["a1"].encode(), "a1", env).encode()
    with pytest.raises(EnvelopeError) as info:
        ring.verify(fields)
    assert not isinstance(info.value, AuthError)
    assert info.value.reason == "missing"


def test_auth_verify_accepts_non_canonical_bytes_as_signed(ring: Keyring) -> None:
    # the MAC covers the bytes as sent; an encoder that writes 1900000000 (not .0) and
    # spaces still verifies, and the envelope is the same request
    env = (
        b'{ "message_id": "m-1", "sender": "alice", "payload": {"q": "h\\u00e9llo"},'
        b' "deadline": 1900000000 }'
    )
    fields = {b"v": b"1", b"env": env, b"kid": b"a1"}
    fields[b"sig"] = signature(KEYS["alice"]["a1"].encode(), "a1", env).encode()
    auth = ring.authenticate(fields)
    assert auth.envelope.fingerprint() == _env().fingerprint()


def test_auth_keyring_repr_hides_secrets(ring: Keyring) -> None:
    assert "secret" not in repr(ring)


def test_auth_check_stream_principal() -> None:
    fields = _b(unsigned_fields(_env("alice")))
    assert check_stream_principal(fields, "alice").principal == "alice"
    with pytest.raises(AuthError) as info:
        check_stream_principal(fields, "bob")
    assert info.value.reason == "sender_mismatch"
    with pytest.raises(AuthError) as missing:
        check_stream_principal({b"v": b"1"}, "alice")
    assert missing.value.reason == "missing_field"


def test_auth_sign_unknown_principal_or_key(ring: Keyring) -> None:
    with pytest.raises(AuthError) as info:
        ring.sign(_env("carol"))
    assert info.value.reason == "unknown_principal"
    with pytest.raises(AuthError) as info2:
        ring.sign(_env(), kid="nope")
    assert info2.value.reason == "unknown_key"


# -- loading ---------------------------------------------------------------------------------


def _write(tmp_path: Path, content: str | bytes) -> Path:
    path = tmp_path / "keys.json"
    if isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    else:
        path.write_bytes(content)
    path.chmod(0o600)
    return path


def test_auth_keyring_load_ok(tmp_path: Path) -> None:
    ring = Keyring.load(_write(tmp_path, json.dumps(KEYS)))
    assert ring.principals == ("alice", "bob")
    assert ring.key_ids("alice") == ("a1", "a2")
    assert ring.default_kid("bob") == "b1"


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        ("[]", "top level"),
        ("{}", "at least one principal"),
        ('{"alice": "secret"}', "object of key ids"),
        ('{"alice": {}}', "at least one"),
        ('{"alice": {"a1": ""}}', "0 bytes, at least 32"),
        ('{"alice": {"a1": 5}}', "must be a string"),
        ('{"bad name": {"a1": "x"}}', "bad principal name"),
        ('{"": {"a1": "x"}}', "bad principal name"),
        ('{"alice": {"a 1": "x"}}', "bad key id"),
        ('{"alice": {"": "x"}}', "bad key id"),
    ],
)
def test_auth_keyring_load_rejects_bad_file(
    tmp_path: Path, content: str | bytes, needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle):
        Keyring.load(_write(tmp_path, content))


@pytest.mark.parametrize(("size", "accepted"), [(31, False), (32, True)])
def test_auth_keyring_refuses_secrets_under_32_bytes(size: int, accepted: bool) -> None:
    keys = {"alice": {"a1": "x" * size}}
    if accepted:
        assert Keyring(keys).key_ids("alice") == ("a1",)
        return
    with pytest.raises(ConfigError, match=r"secret alice/a1 is 31 bytes, at least 32"):
        Keyring(keys)


def test_auth_keyring_counts_secret_bytes_not_characters() -> None:
    # 16 two-byte characters: 32 bytes of UTF-8, accepted; 31 bytes given as bytes, refused
    assert Keyring({"alice": {"a1": "é" * 16}}).principals == ("alice",)
    with pytest.raises(ConfigError, match="alice/a1"):
        Keyring({"alice": {"a1": b"\x00" * 31}})


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602, 0o666])
def test_auth_keyring_load_refuses_file_others_may_read_or_write(tmp_path: Path, mode: int) -> None:
    path = _write(tmp_path, json.dumps(KEYS))
    path.chmod(mode)
    with pytest.raises(ConfigError, match=f"mode {mode:04o}.*chmod 600 {path}"):
        Keyring.load(path)


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o700])
def test_auth_keyring_load_accepts_file_only_its_owner_may_use(tmp_path: Path, mode: int) -> None:
    path = _write(tmp_path, json.dumps(KEYS))
    path.chmod(mode)
    assert Keyring.load(path).principals == ("alice", "bob")


def test_auth_keyring_load_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read keyring"):
        Keyring.load(tmp_path / "absent.json")
    with pytest.raises(ConfigError, match="cannot read keyring"):
        Keyring.load(tmp_path)  # a directory
