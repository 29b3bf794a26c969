"""Hostile entries the harness plants: poison of every shape on the inbound stream, forged
and poisoned replies on the reply streams, and byte-identical copies of real requests.

Every planted entry carries a marker as its FIRST field, so that the final read can tell it
apart even from a bounded dead letter (which copies fields in order, up to
``max_entry_fields`` and ``max_entry_bytes``): ``chaos_key`` (the agent's
``<principal>:<id>``) on inbound poison, ``chaos_forged`` (the forgery's mark) on reply
stream entries. Forged reply bodies also hold ``chaos_forged`` and the status
``FORGED_STATUS``, so a receipt or a receiver effect made from one shows where it came from.
A replay carries no marker: it is a copy of a real entry, byte for byte.

Each shape comes with the dead-letter reasons the product must give it (``reasons``); the
checker holds every planted entry to them.

Inbound shapes (``INBOUND_SHAPES``; a signed envelope wherever the shape allows one, so that
only the shape is wrong):

* ``wide_4k`` / ``wide_10k``: ~4,000 / ~10,000 fields (``too_many_fields``);
* ``dup_field``: the field ``env`` twice (``duplicate_field``);
* ``surrogate_name``: a member named ``"\\ud800"`` (a lone surrogate) inside ``env``, with a
  valid HMAC over those bytes (``unknown_field``);
* ``deep_payload``: a payload nested 100 levels, signed (``too_deep``);
* ``deep_json``: ``env`` nested 50,000 levels, signed: the JSON parser gives up
  (``unparseable``);
* ``far_deadline``: a deadline 30 days ahead, past the retention window (``too_large``);
* ``oversize``: a signed envelope with a 300 KB field beside it (``oversize``);
* ``oversize_64m``: the same with 64 MB beside it (``oversize``, found inside Redis).

Entry id shapes (``ENTRY_ID_SHAPES``, ``chosen_id``): any inbound poison planted at an id the
writer chose, as a user with ``+xadd`` can: ``future_id`` (about 11.6 days ahead of the
server clock: every later ``*`` id follows it; the trim raises its alarm and goes on) and
``max_id`` (the largest id: every later ``XADD *`` fails until ``broker-adapter streams
repair``). The entry itself gets its shape's reason as usual.

Reply shapes: forgeries (``FORGERY_SHAPES``: unsigned v1, unsigned v2, a wrong secret,
another principal's key id, another principal's secret under the right key id) and poison
(``REPLY_POISON_SHAPES``: ~4,000 / ~10,000 fields, a repeated field, an entry over the
receiver's megabyte, one of 64 MB, a validly signed body nested past the receiver's depth
limit, a validly signed body made 30 days ago: a replay past the receiver's window).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from broker_adapter.protocol.canonical import canonical_json, sha256_hex
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.signing import (
    REPLY_WIRE_VERSION,
    WIRE_VERSION,
    reply_signature,
    signature,
)
from tests.chaos.finalread import CHAOS_FORGED_FIELD, CHAOS_KEY_FIELD, FORGED_STATUS

Pairs = list[tuple[bytes, bytes]]

#: Inbound poison shape -> the dead-letter reasons the ingest may give it.
INBOUND_SHAPES: dict[str, tuple[str, ...]] = {
    "wide_4k": ("too_many_fields",),
    "wide_10k": ("too_many_fields",),
    "dup_field": ("duplicate_field",),
    "surrogate_name": ("unknown_field",),
    "deep_payload": ("too_deep",),
    "deep_json": ("unparseable",),
    "far_deadline": ("too_large",),
    "oversize": ("oversize",),
    "oversize_64m": ("oversize",),
}
#: Forged reply shape -> the receiver's dead-letter reasons.
FORGERY_SHAPES: dict[str, tuple[str, ...]] = {
    "unsigned_v1": ("bad_reply",),
    "unsigned_v2": ("missing_field",),
    "wrong_secret": ("bad_signature",),
    "other_key": ("unknown_key",),
    "other_secret": ("bad_signature",),
}
#: Poisoned reply shape -> the receiver's dead-letter reasons.
REPLY_POISON_SHAPES: dict[str, tuple[str, ...]] = {
    "wide_4k": ("too_many_fields",),
    "wide_10k": ("too_many_fields",),
    "dup_field": ("duplicate_field",),
    "oversize": ("oversize",),
    "oversize_64m": ("oversize",),
    "deep_body": ("bad_reply",),
    "stale_body": ("stale",),
}
#: Entry id shapes: what a writer that chooses ids plants an entry at.
ENTRY_ID_SHAPES = ("future_id", "max_id")
#: The largest stream id.
MAX_ID = "18446744073709551615-18446744073709551615"
#: How far ahead of the server clock ``future_id`` is, ms.
FUTURE_AHEAD_MS = 10**9
WIDE_FIELDS = {"wide_4k": 4_000, "wide_10k": 10_000}
DEEP_PAYLOAD_LEVELS = 100
DEEP_JSON_LEVELS = 50_000
INBOUND_OVERSIZE_BYTES = 300 * 1024  # the ingest's default limit is 256 KiB
REPLY_OVERSIZE_BYTES = 1100 * 1024  # the receiver's default limit is 1 MiB
DEEP_BODY_LEVELS = 100  # the receiver's limit is 64
FAR_DEADLINE_S = 30 * 86400.0  # the retention window is 7 days
HUGE_BYTES = 64 * 1024 * 1024  # the ``oversize_64m`` shapes
STALE_AGE_S = 30 * 86400.0  # a receiver's window is under its 7-day retention
_HOLE = '"@@chaos-hole@@"'


def _filler(n: int) -> Pairs:
    return [(f"chaos_f{i:05d}".encode(), b"x") for i in range(n)]


def _nested(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def _misshaped(shape: str, pairs: Pairs, repeated: bytes, oversize: int) -> Pairs:
    """``pairs`` made wide, given a repeated field ``repeated`` or padded past ``oversize``
    bytes, as ``shape`` says; other shapes keep their fields."""
    if shape in WIDE_FIELDS:
        return pairs + _filler(WIDE_FIELDS[shape] - len(pairs))
    if shape == "dup_field":
        return [*pairs, (repeated, b"{}")]
    if shape == "oversize":
        return [*pairs, (b"chaos_pad", b"p" * oversize)]
    if shape == "oversize_64m":
        return [*pairs, (b"chaos_pad", b"p" * HUGE_BYTES)]
    return pairs


def _signed_env(env: bytes, kid: str, secret: str) -> Pairs:
    return [
        (b"v", WIRE_VERSION.encode()),
        (b"env", env),
        (b"kid", kid.encode()),
        (b"sig", signature(secret.encode(), kid, env).encode()),
    ]


def inbound_poison(
    shape: str, *, key: str, principal: str, ident: str, kid: str, secret: str, deadline_s: float
) -> Pairs:
    """The fields of one inbound poison entry of ``shape``, ``chaos_key`` first.

    Args:
        shape: one of ``INBOUND_SHAPES``.
        key: the harness's key for it (``<principal>:<ident>``).
        principal, kid, secret: who signs it (the agent itself).
        ident: its message id.
        deadline_s: the deadline of the envelope, seconds from now (not ``far_deadline``).
    """
    deadline = time.time() + (FAR_DEADLINE_S if shape == "far_deadline" else deadline_s)
    envelope = Envelope.build(
        message_id=ident,
        sender=principal,
        payload={"kind": "ok", "value": f"{shape}-{key}"},
        deadline=deadline,
    )
    env = envelope.to_json()
    if shape == "surrogate_name":
        env = b'{"\\ud800":1,' + env[1:]
    elif shape in ("deep_payload", "deep_json"):
        holder = canonical_json(dict(envelope.to_dict(), payload={"deep": "@@chaos-hole@@"}))
        levels = DEEP_PAYLOAD_LEVELS if shape == "deep_payload" else DEEP_JSON_LEVELS
        env = holder.replace(_HOLE.encode(), _nested(levels))
    elif shape not in INBOUND_SHAPES:
        raise ValueError(f"unknown inbound shape {shape!r}")
    pairs: Pairs = [(CHAOS_KEY_FIELD, key.encode()), *_signed_env(env, kid, secret)]
    return _misshaped(shape, pairs, b"env", INBOUND_OVERSIZE_BYTES)


def forged_body(
    mark: str,
    principal: str,
    reply_id: str,
    task_id: str,
    message_id: str,
    *,
    deep: bool = False,
    stale: bool = False,
) -> bytes:
    """A plausible reply body for ``reply_id`` that says where it came from (``stale``:
    made ``STALE_AGE_S`` ago)."""
    body: dict[str, Any] = {
        "v": 1,
        "reply_id": reply_id,
        "task_id": task_id,
        "principal": principal,
        "message_id": message_id,
        "correlation_id": None,
        "status": FORGED_STATUS,
        "result": {"forged": True, "deep": "@@chaos-hole@@" if deep else None},
        "error": None,
        "attempts": 1,
        "fence": 1,
        "chaos_forged": mark,
        "finished_at": time.time() - (STALE_AGE_S if stale else 0.0),
    }
    raw = canonical_json(body)
    return raw.replace(_HOLE.encode(), _nested(DEEP_BODY_LEVELS)) if deep else raw


def reply_entry(
    shape: str,
    *,
    mark: str,
    principal: str,
    reply_id: str,
    body: bytes,
    keyring: Mapping[str, Mapping[str, str]],
    other: str | None,
) -> Pairs:
    """The fields of one forged or poisoned reply entry, ``chaos_forged`` first.

    Args:
        shape: one of ``FORGERY_SHAPES`` or ``REPLY_POISON_SHAPES``.
        mark: the forgery's mark (``chaos_forged``).
        principal: whose reply stream it goes to.
        reply_id, body: what it claims.
        keyring: every principal's keys (the harness knows them all).
        other: another principal, for ``other_key`` / ``other_secret``.
    """
    if shape not in FORGERY_SHAPES and shape not in REPLY_POISON_SHAPES:
        raise ValueError(f"unknown reply shape {shape!r}")
    kid, secret = next(iter(keyring[principal].items()))
    if shape in ("other_key", "other_secret"):
        if other is None:
            raise ValueError(f"{shape} needs another principal")
        other_kid, other_secret = next(iter(keyring[other].items()))
        if shape == "other_key":
            kid = other_kid
        secret = other_secret
    elif shape == "wrong_secret":
        secret += "-wrong"
    version = b"1" if shape == "unsigned_v1" else REPLY_WIRE_VERSION.encode()
    pairs: Pairs = [
        (CHAOS_FORGED_FIELD, mark.encode()),
        (b"v", version),
        (b"reply_id", reply_id.encode()),
        (b"hash", sha256_hex(body).encode()),
        (b"body", body),
    ]
    if shape not in ("unsigned_v1", "unsigned_v2"):
        sig = reply_signature(secret.encode(), kid, principal, reply_id, body)
        pairs += [(b"kid", kid.encode()), (b"sig", sig.encode())]
    return _misshaped(shape, pairs, b"body", REPLY_OVERSIZE_BYTES)


def chosen_id(shape: str, server_ms: int) -> str:
    """The id of an entry of id shape ``shape`` (``ENTRY_ID_SHAPES``), given the server's
    clock in ms (``TIME``)."""
    if shape == "future_id":
        return f"{server_ms + FUTURE_AHEAD_MS}-0"
    if shape == "max_id":
        return MAX_ID
    raise ValueError(f"unknown entry id shape {shape!r}")


def flat(pairs: Pairs) -> list[bytes]:
    """``XADD`` arguments after the id: names and values in order (repeats kept)."""
    return [item for pair in pairs for item in pair]
