"""Who sent an entry: HMAC signatures over the envelope bytes, and the keyring that checks them.

Invariant kept: a request's principal comes from a trusted check, never from a body field
alone (``docs/RULES.md`` rule 2). In signed mode the principal is the ``sender`` named in the
envelope *only if* the entry's HMAC verifies with one of that principal's keys; otherwise the
entry is refused with an ``AuthError`` and dead-lettered by the caller. In ACL mode
(``check_stream_principal``) the stream itself names the principal, because Redis ACLs let
only that principal write it, and ``sender`` must match it.

Wire form of one stream entry (see ``docs/PROTOCOL.md``)::

    v    "1"
    env  canonical JSON bytes of the envelope
    kid  key id of the signing key
    sig  lowercase hex HMAC-SHA256(secret, b"ba.v1\\n" + kid + b"\\n" + env)

The MAC covers ``env`` exactly as received (nothing is re-encoded before checking), and the
key id, so a signature cannot be replayed under another key. Digests are compared in
constant time.

Replies are signed too, by the adapter, with the keys of the principal they are addressed
to (``Keyring.sign_reply``; the receiver checks them with ``Keyring.verify_reply``). A reply
entry on ``replies(P)`` carries, besides ``v`` = ``REPLY_WIRE_VERSION``, ``reply_id``,
``hash`` and ``body``::

    kid  key id of P's signing key (P's default, its first key id)
    sig  lowercase hex HMAC-SHA256(secret, b"ba.reply.v1\\n" + kid + b"\\n" + P + b"\\n"
                                           + reply_id + b"\\n" + body)

Why these keys: the receiver of P already holds P's secret (it signs P's requests with it),
so no new key distribution is needed, the same rotation works (sign with the first key id,
verify with any), and no other principal can make a reply P accepts. Why this message: the
domain ``ba.reply.v1`` differs from the request's ``ba.v1``, so a request signature never
verifies as a reply signature (nor the other way round); the principal and the reply id are
inside the MAC, so a signed reply cannot be moved to another stream or another reply id.
Neither a principal nor a key id nor a reply id holds a newline (``parse_entry`` refuses
such a reply id), so the fields cannot be shifted against each other. The HMAC is
deterministic: publishing the same outbox row again gives the same entry, and nothing about
the signature needs to be stored.

Crash safety: this module is pure computation with no state; a crash loses nothing.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from broker_adapter.errors import AuthError, ConfigError, EnvelopeError
from broker_adapter.private_files import read_private_json
from broker_adapter.protocol.envelope import Envelope, check_principal

WIRE_VERSION = "1"
SIGNATURE_DOMAIN = b"ba.v1\n"
#: Version of a reply entry; a receiver refuses any other (``"1"``, an unsigned form, too).
REPLY_WIRE_VERSION = "2"
REPLY_SIGNATURE_DOMAIN = b"ba.reply.v1\n"
FIELD_VERSION = "v"
FIELD_ENV = "env"
FIELD_KID = "kid"
FIELD_SIG = "sig"
KID_MAX_BYTES = 64
#: A shorter secret is refused: a short one is found offline, from one signed entry, by
#: trying candidates against its HMAC.
SECRET_MIN_BYTES = 32
KID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")

EntryFields = Mapping[bytes, bytes]

_B_VERSION = FIELD_VERSION.encode()
_B_ENV = FIELD_ENV.encode()
_B_KID = FIELD_KID.encode()
_B_SIG = FIELD_SIG.encode()
_B_WIRE_VERSION = WIRE_VERSION.encode()


def signature(secret: bytes, kid: str, env: bytes) -> str:
    """The entry signature: lowercase hex HMAC-SHA256 over ``b"ba.v1\\n" + kid + b"\\n" + env``.

    Args:
        secret: the key's secret bytes (UTF-8 of the string in the keyring file).
        kid: the key id, ASCII.
        env: the envelope bytes exactly as they go into the ``env`` field.

    Returns:
        64 lowercase hex characters.
    """
    return hmac.digest(secret, SIGNATURE_DOMAIN + kid.encode("ascii") + b"\n" + env, "sha256").hex()


def reply_signature(secret: bytes, kid: str, principal: str, reply_id: str, body: bytes) -> str:
    """A reply entry's signature: lowercase hex HMAC-SHA256 over ``b"ba.reply.v1\\n" + kid +
    b"\\n" + principal + b"\\n" + reply_id + b"\\n" + body``.

    Args:
        secret: the addressed principal's key.
        kid: the key id, ASCII.
        principal: the principal the reply is addressed to (whose stream it goes to).
        reply_id: the reply's id, UTF-8.
        body: the body bytes exactly as they go into the ``body`` field.

    Returns:
        64 lowercase hex characters.
    """
    message = b"\n".join(
        (kid.encode("ascii"), principal.encode("utf-8"), reply_id.encode("utf-8"), body)
    )
    return hmac.digest(secret, REPLY_SIGNATURE_DOMAIN + message, "sha256").hex()


class ReplySignature(NamedTuple):
    """The ``kid`` and ``sig`` fields of one reply entry."""

    kid: str
    sig: str


def check_kid(kid: str) -> str:
    """Validate a key id: 1..64 characters from letters, digits, ``.``, ``_``, ``:``, ``-``.

    Raises:
        ConfigError: the key id is empty, too long or holds other characters.
    """
    if not 1 <= len(kid) <= KID_MAX_BYTES or not set(kid) <= KID_CHARS:
        raise ConfigError(
            f"bad key id {kid!r}: 1..{KID_MAX_BYTES} characters of letters, digits, '._:-'"
        )
    return kid


class Authenticated(NamedTuple):
    """An entry whose principal was established by a trusted check (an immutable tuple:
    one is made per inbound entry, so it is the cheapest immutable record there is).

    Attributes:
        principal: the authenticated principal.
        envelope: the validated envelope; its ``sender`` equals ``principal``.
        kid: the key id that verified (``None`` in ACL mode).
    """

    principal: str
    envelope: Envelope
    kid: str | None = None


def _field(fields: EntryFields, name: bytes) -> bytes:
    value = fields.get(name)
    if value is None:
        raise AuthError(name.decode(), "missing_field", f"entry has no {name.decode()!r} field")
    return value


def _check_version(fields: EntryFields) -> None:
    version = _field(fields, _B_VERSION)
    if version != _B_WIRE_VERSION:
        shown = version[:16].decode("utf-8", "replace")
        raise AuthError(
            FIELD_VERSION, "bad_version", f"wire version {shown!r} is not {WIRE_VERSION!r}"
        )


class Keyring:
    """Secrets per principal and key id; signs and verifies stream entries.

    Args:
        keys: ``{principal: {key id: secret}}``. Secrets given as ``str`` are used as their
            UTF-8 bytes. Within a principal the first key id is its default signing key.

    Raises:
        ConfigError: the mapping has the wrong shape, a secret shorter than
            ``SECRET_MIN_BYTES``, a bad principal name or a bad key id.
    """

    def __init__(self, keys: Mapping[str, Mapping[str, str | bytes]]) -> None:
        if not isinstance(keys, Mapping) or not keys:
            raise ConfigError("keyring must map at least one principal to its keys")
        table: dict[str, dict[str, bytes]] = {}
        for principal, kids in keys.items():
            if not isinstance(principal, str):
                raise ConfigError(f"keyring: principal {principal!r} is not a string")
            try:
                check_principal(principal, "principal")
            except EnvelopeError as exc:
                raise ConfigError(f"keyring: bad principal name {principal!r}: {exc}") from None
            if not isinstance(kids, Mapping) or not kids:
                raise ConfigError(
                    f"keyring: principal {principal!r} must map key ids to secrets (at least one)"
                )
            own: dict[str, bytes] = {}
            for kid, secret in kids.items():
                if not isinstance(kid, str):
                    raise ConfigError(f"keyring: {principal!r} has a key id that is not a string")
                check_kid(kid)
                if isinstance(secret, str):
                    secret = secret.encode("utf-8")
                if not isinstance(secret, bytes):
                    raise ConfigError(f"keyring: secret {principal}/{kid} is not a string")
                if len(secret) < SECRET_MIN_BYTES:
                    raise ConfigError(
                        f"keyring: secret {principal}/{kid} is {len(secret)} bytes, at least"
                        f" {SECRET_MIN_BYTES} are required (use 32 random bytes, e.g. 43"
                        " characters of base64url)"
                    )
                own[kid] = secret
            table[principal] = own
        self._keys = table

    @classmethod
    def load(cls, path: str | Path) -> Keyring:
        """Read a keyring file: JSON ``{"<principal>": {"<key id>": "<secret>"}}``.

        Raises:
            ConfigError: the file cannot be read, is readable or writable by its group or
                others (``chmod 600`` it), is not UTF-8 JSON, or has the wrong shape.
        """
        data = read_private_json(path, "keyring", refused_bits=0o066)
        return cls.from_json_value(data, source=str(path))

    @classmethod
    def from_json_value(cls, data: Any, *, source: str = "keyring") -> Keyring:
        """Build from parsed JSON, checking that every secret is a string.

        Raises:
            ConfigError: the value has the wrong shape.
        """
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: top level must be an object of principals")
        for principal, kids in data.items():
            if not isinstance(kids, dict):
                raise ConfigError(f"{source}: {principal!r} must be an object of key ids")
            for kid, secret in kids.items():
                if not isinstance(secret, str):
                    raise ConfigError(f"{source}: secret {principal}/{kid} must be a string")
        try:
            return cls(data)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    # -- lookups ----------------------------------------------------------------------------

    @property
    def principals(self) -> tuple[str, ...]:
        return tuple(self._keys)

    def key_ids(self, principal: str) -> tuple[str, ...]:
        """The key ids of ``principal``, the default (signing) one first."""
        return tuple(self._keys.get(principal, ()))

    def default_kid(self, principal: str) -> str:
        """The key id ``principal`` signs with unless told otherwise.

        Raises:
            AuthError: reason ``unknown_principal``.
        """
        kids = self._keys.get(principal)
        if not kids:
            raise AuthError("sender", "unknown_principal", f"no keys for principal {principal!r}")
        return next(iter(kids))

    def _secret(self, principal: str, kid: str) -> bytes:
        kids = self._keys.get(principal)
        if kids is None:
            raise AuthError("sender", "unknown_principal", f"no keys for principal {principal!r}")
        secret = kids.get(kid)
        if secret is None:
            raise AuthError(FIELD_KID, "unknown_key", f"principal {principal!r} has no key {kid!r}")
        return secret

    # -- signing ----------------------------------------------------------------------------

    def sign(self, envelope: Envelope, kid: str | None = None) -> dict[str, bytes]:
        """The stream entry fields for ``envelope``, signed as its ``sender``.

        Args:
            envelope: the request; its ``sender`` is the signing principal.
            kid: the key to sign with; default the principal's first key.

        Returns:
            ``{"v", "env", "kid", "sig"}`` as bytes, ready for XADD.

        Raises:
            AuthError: the sender has no keys (``unknown_principal``) or no key ``kid``
                (``unknown_key``).
        """
        principal = envelope.sender
        kid = kid if kid is not None else self.default_kid(principal)
        env = envelope.to_json()
        sig = signature(self._secret(principal, kid), kid, env)
        return {
            FIELD_VERSION: WIRE_VERSION.encode(),
            FIELD_ENV: env,
            FIELD_KID: kid.encode("ascii"),
            FIELD_SIG: sig.encode("ascii"),
        }

    def sign_reply(
        self, principal: str, reply_id: str, body: bytes, kid: str | None = None
    ) -> ReplySignature:
        """Sign a reply addressed to ``principal`` with one of ``principal``'s keys.

        Args:
            principal: whose reply stream the entry goes to.
            reply_id: the reply's id.
            body: the body bytes of the entry.
            kid: the key to sign with; default the principal's first key.

        Raises:
            AuthError: the principal has no keys (``unknown_principal``) or no key ``kid``
                (``unknown_key``).
        """
        kid = kid if kid is not None else self.default_kid(principal)
        secret = self._secret(principal, kid)
        return ReplySignature(kid, reply_signature(secret, kid, principal, reply_id, body))

    # -- verifying --------------------------------------------------------------------------

    def verify_reply(
        self, principal: str, reply_id: str, body: bytes, kid: bytes, sig: bytes
    ) -> str:
        """Check a reply entry's signature against the keys of the principal it is for.

        Args:
            principal: the receiver's principal (never taken from the entry).
            reply_id: the entry's ``reply_id``.
            body: the entry's ``body`` bytes.
            kid: the entry's ``kid`` field.
            sig: the entry's ``sig`` field.

        Returns:
            the key id that verified.

        Raises:
            AuthError: ``unknown_principal`` (no keys for ``principal``), ``unknown_key``
                (``kid`` is not one of its key ids) or ``bad_signature``.
        """
        key_id = _kid_text(kid)
        secret = self._secret(principal, key_id)
        expected = reply_signature(secret, key_id, principal, reply_id, body).encode("ascii")
        if not hmac.compare_digest(expected, sig):
            raise AuthError(
                FIELD_SIG,
                "bad_signature",
                f"reply signature does not verify with {principal}/{key_id}",
            )
        return key_id

    def verify(self, fields: EntryFields) -> str:
        """The authenticated principal of a signed entry.

        Raises:
            AuthError: with ``reason`` ``missing_field``, ``bad_version``,
                ``unknown_principal``, ``unknown_key``, ``bad_signature`` or
                ``sender_mismatch``.
            EnvelopeError: ``env`` is not a valid envelope (its reason says why).
        """
        return self.authenticate(fields).principal

    def authenticate(self, fields: EntryFields) -> Authenticated:
        """Check a signed entry and return its principal together with the parsed envelope.

        The envelope is parsed first (its ``sender`` names the principal whose key is looked
        up), then the HMAC is checked; the principal counts only if the HMAC verifies.

        Raises:
            AuthError: see ``verify``.
            EnvelopeError: ``env`` is not a valid envelope.
        """
        get = fields.get
        env, raw_kid, sig = get(_B_ENV), get(_B_KID), get(_B_SIG)
        if get(_B_VERSION) != _B_WIRE_VERSION or env is None or raw_kid is None or sig is None:
            # Say what is wrong, in this order: version, then the first missing field.
            _check_version(fields)
            env, raw_kid, sig = (_field(fields, name) for name in (_B_ENV, _B_KID, _B_SIG))
        envelope = Envelope.from_json(env)
        kid = _kid_text(raw_kid)
        principal = envelope.sender
        kids = self._keys.get(principal)
        secret = None if kids is None else kids.get(kid)
        if secret is None:
            # Name the real signer when the key belongs to someone else and verifies: that
            # is a spoofing attempt, worth its own reason.
            signer = self._signer_of(kid, env, sig, exclude=principal)
            if signer is not None:
                raise AuthError(
                    "sender",
                    "sender_mismatch",
                    f"entry signed by {signer!r} (key {kid!r}) claims sender {principal!r}",
                )
            if kids is None:
                raise AuthError(
                    "sender", "unknown_principal", f"no keys for principal {principal!r}"
                )
            raise AuthError(FIELD_KID, "unknown_key", f"principal {principal!r} has no key {kid!r}")
        if not _mac_ok(secret, kid, env, sig):
            raise AuthError(
                FIELD_SIG, "bad_signature", f"signature does not verify with {principal}/{kid}"
            )
        return Authenticated(principal, envelope, kid)

    def _signer_of(self, kid: str, env: bytes, sig: bytes, *, exclude: str) -> str | None:
        for principal, kids in self._keys.items():
            secret = kids.get(kid)
            if principal != exclude and secret is not None and _mac_ok(secret, kid, env, sig):
                return principal
        return None

    def __repr__(self) -> str:  # never print secrets
        return f"Keyring(principals={list(self._keys)})"


def _kid_text(raw: bytes) -> str:
    """An entry's ``kid`` field as text; one that is not ASCII names no key of ours.

    Raises:
        AuthError: ``unknown_key``.
    """
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise AuthError(FIELD_KID, "unknown_key", "key id is not ASCII") from None


def _mac_ok(secret: bytes, kid: str, env: bytes, sig: bytes) -> bool:
    expected = signature(secret, kid, env).encode("ascii")
    return hmac.compare_digest(expected, sig)


def check_stream_principal(fields: EntryFields, principal: str) -> Authenticated:
    """ACL mode: the stream's principal is authenticated by Redis; ``sender`` must match it.

    Args:
        fields: the entry fields (``v`` and ``env``; ``kid`` and ``sig`` are ignored).
        principal: the principal whose stream the entry was read from.

    Raises:
        AuthError: ``missing_field``, ``bad_version`` or ``sender_mismatch``.
        EnvelopeError: ``env`` is not a valid envelope.
    """
    _check_version(fields)
    envelope = Envelope.from_json(_field(fields, _B_ENV))
    if envelope.sender != principal:
        raise AuthError(
            "sender",
            "sender_mismatch",
            f"entry on {principal!r}'s stream claims sender {envelope.sender!r}",
        )
    return Authenticated(principal, envelope, None)


def unsigned_fields(envelope: Envelope) -> dict[str, bytes]:
    """The entry fields for ACL mode: ``{"v", "env"}``, no signature."""
    return {FIELD_VERSION: WIRE_VERSION.encode(), FIELD_ENV: envelope.to_json()}
