"""Checking one signed reply entry (stream entry or result record) into a ``Reply``.

The checks a requester runs on a reply before it trusts it, in the receiver's order
(``docs/PROTOCOL.md`` section 10): the entry format version, the fields, the signature
(before anything in the body is read), the content hash, the body, and that the body names
the reply id and the principal of the entry.
"""

from __future__ import annotations

from collections.abc import Mapping

from broker_adapter.errors import AuthError
from broker_adapter.protocol.canonical import sha256_hex
from broker_adapter.protocol.reply import BadReply, Reply, load_body
from broker_adapter.protocol.signing import REPLY_WIRE_VERSION, Keyring

_REPLY_ENTRY_FIELDS = (b"v", b"reply_id", b"hash", b"body", b"kid", b"sig")
_VERSION = REPLY_WIRE_VERSION.encode()


def verify_reply_entry(fields: Mapping[bytes, bytes], principal: str, keyring: Keyring) -> Reply:
    """The ``Reply`` of a reply entry addressed to ``principal``, once it is proven to be
    one the adapter signed for ``principal``.

    Raises:
        BadReply: ``bad_reply`` (fields, version, body), ``missing_field``,
            ``unknown_key``, ``bad_signature``, ``bad_hash`` or ``wrong_principal``.
    """
    missing = [f.decode() for f in _REPLY_ENTRY_FIELDS[:4] if f not in fields]
    if missing:
        raise BadReply("bad_reply", f"missing field(s): {', '.join(missing)}")
    if fields[b"v"] != _VERSION:
        raise BadReply("bad_reply", f"reply format version is not {REPLY_WIRE_VERSION!r}")
    kid, sig = fields.get(b"kid"), fields.get(b"sig")
    if kid is None or sig is None:
        raise BadReply("missing_field", "unsigned reply: no 'kid' or no 'sig' field")
    try:
        reply_id = bytes(fields[b"reply_id"]).decode("utf-8")
        content_hash = bytes(fields[b"hash"]).decode("ascii")
    except UnicodeDecodeError:
        raise BadReply("bad_reply", "reply id or hash is not text") from None
    if "\n" in reply_id:
        raise BadReply("bad_reply", "reply id holds a newline")
    body = bytes(fields[b"body"])
    try:
        keyring.verify_reply(principal, reply_id, body, kid, sig)
    except AuthError as exc:
        raise BadReply(exc.reason, exc.detail) from None
    if sha256_hex(body) != content_hash:
        raise BadReply("bad_hash", "body does not hash to the entry's hash")
    decoded = load_body(body)
    if decoded.get("reply_id") != reply_id:
        raise BadReply("bad_reply", f"body names reply {decoded.get('reply_id')!r}")
    if decoded.get("principal") != principal:
        raise BadReply("wrong_principal", f"reply for {decoded.get('principal')!r}")
    return Reply.from_mapping(decoded)
