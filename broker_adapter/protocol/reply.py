"""The reply body: the one module that builds it and parses it.

A reply body is a JSON object, stored canonically (``encode_body``) in the outbox when its
task ends and published unchanged, so every resend carries the same bytes. Its fields::

    v                   1
    reply_id            the reply's id (``reply_id_for`` of the task, or a conflict id)
    task_id             the task answered (a conflict answer names the stored task)
    principal           whose request it answers (and whose stream it goes to)
    message_id          the request's message id
    correlation_id      the request's correlation id, or null
    status              the task's terminal state (done, failed, cancelled, expired,
                        hop_limit), or "conflict"
    result              the handler's result (a JSON value) for done, else null
    error               why it did not succeed, else null
    attempts, fence     the attempt and fencing token the outcome was committed under
    finished_at         when the task ended (seconds since the epoch)
    fingerprint, stored_fingerprint    a conflict answer only: the refused request's content
                        hash and the stored one's
    answered_at         a conflict answer only: when it was made (seconds since the epoch)

A terminal reply carries ``attempts``, ``fence`` and ``finished_at``; a conflict answer
carries the two fingerprints and ``answered_at`` instead. Either time is the reply's age
(``Reply.made_at``), which a receiver checks against its window. The receiver decodes a
body with ``load_body`` and makes it a ``Reply`` (``Reply.from_mapping``), the value an
effect is given.

The entry around the body (``v``, ``reply_id``, ``hash``, ``body``, ``kid``, ``sig``) and its
signature are ``signing``'s (``Keyring.sign_reply`` / ``verify_reply``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from broker_adapter.errors import BrokerAdapterError
from broker_adapter.protocol.canonical import canonical_json, loads_strict, sha256_hex

#: The body format's version (the ``v`` field).
BODY_VERSION: Final = 1
#: The ``status`` of the answer to a message id reused with other content.
CONFLICT_STATUS: Final = "conflict"
#: How deep a reply body may nest: the body object plus a result within the payload
#: limits nest 17 levels; anything far deeper is not a reply of ours.
REPLY_MAX_DEPTH: Final = 64


class BadReply(BrokerAdapterError):
    """An entry that is not a well-formed reply (the receiver dead-letters it)."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{detail} [{reason}]")


def reply_id_for(task_id: str) -> str:
    """The stable reply id of a task's terminal reply."""
    return f"r-{task_id}"


def terminal_body(
    task_id: str,
    status: str,
    principal: str,
    message_id: str,
    correlation_id: str | None,
    result: str | None,
    error: str | None,
    attempts: int,
    fence: int,
    finished_at: float,
    *,
    traceparent: str | None = None,
    effects: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A terminal reply's body (``result`` is the stored canonical JSON text), with the
    request's ``traceparent`` when it had one, and ``effects`` (how a reconcile ended an
    ``unknown`` task: ``reconciled``, ``compensations``; ``docs/PROTOCOL.md`` section 11)
    when there is something to say."""
    body: dict[str, Any] = {
        "v": BODY_VERSION,
        "reply_id": reply_id_for(task_id),
        "task_id": task_id,
        "principal": principal,
        "message_id": message_id,
        "correlation_id": correlation_id,
        "status": status,
        "result": None if result is None else json.loads(result),
        "error": error,
        "attempts": attempts,
        "fence": fence,
        "finished_at": finished_at,
    }
    if traceparent is not None:  # only requests sent with one carry it
        body["traceparent"] = traceparent
    if effects:  # only tasks an external effect's reconcile ended carry it
        body["effects"] = dict(effects)
    return body


def conflict_body(
    reply_id: str,
    task_id: str,
    principal: str,
    message_id: str,
    correlation_id: str | None,
    error: str,
    fingerprint: str,
    stored_fingerprint: str,
    *,
    traceparent: str | None = None,
    answered_at: float | None = None,
) -> dict[str, Any]:
    """The body of the answer to ``(principal, message_id)`` reused with other content
    (``fingerprint``); ``task_id`` and ``stored_fingerprint`` are the stored request's,
    ``traceparent`` the resend's trace context, if it had one."""
    body: dict[str, Any] = {
        "v": BODY_VERSION,
        "reply_id": reply_id,
        "task_id": task_id,
        "principal": principal,
        "message_id": message_id,
        "correlation_id": correlation_id,
        "status": CONFLICT_STATUS,
        "result": None,
        "error": error,
        "fingerprint": fingerprint,
        "stored_fingerprint": stored_fingerprint,
    }
    if answered_at is not None:
        body["answered_at"] = answered_at
    if traceparent is not None:
        body["traceparent"] = traceparent
    return body


def encode_body(body: Mapping[str, Any]) -> tuple[bytes, str]:
    """A reply body's canonical bytes and their SHA-256 (what the outbox stores)."""
    data = canonical_json(body)
    return data, sha256_hex(data)


@dataclass(frozen=True)
class Reply:
    """A parsed reply body (see the module docstring for the fields); what a receiver's
    effect is given. Fields a body leaves out are ``None``; ``body`` is the whole object,
    fields this version does not know included."""

    reply_id: str
    status: str | None = None
    task_id: str | None = None
    principal: str | None = None
    message_id: str | None = None
    correlation_id: str | None = None
    result: Any = None
    error: str | None = None
    attempts: int | None = None
    fence: int | None = None
    finished_at: float | None = None
    fingerprint: str | None = None
    stored_fingerprint: str | None = None
    traceparent: str | None = None
    v: int | None = None
    body: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def idempotency_key(self) -> str:
        """Stable across every resend of the reply (derived from its id): the key an
        effect outside the receipt's transaction gives the remote system."""
        return f"ba-reply:{self.reply_id}"

    @property
    def made_at(self) -> float | None:
        """When the reply was made (signed with it): a terminal reply's ``finished_at``, a
        conflict answer's ``answered_at``; ``None`` if the body has neither."""
        if self.finished_at is not None:
            return float(self.finished_at)
        answered = self.body.get("answered_at")
        if isinstance(answered, int | float) and not isinstance(answered, bool):
            return float(answered)
        return None

    @classmethod
    def from_mapping(cls, body: Mapping[str, Any]) -> Reply:
        """The ``Reply`` of a decoded body.

        Raises:
            BadReply: ``bad_reply``: no string ``reply_id``, or a field of the wrong type.
        """
        values: dict[str, Any] = {}
        for name, kind in _FIELD_TYPES.items():
            value = body.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, kind):
                raise BadReply("bad_reply", f"field {name!r} is not {_KIND_NAMES[kind]}")
            values[name] = value
        if "reply_id" not in values:
            raise BadReply("bad_reply", "body names no reply id")
        return cls(**values, result=body.get("result"), body=body)


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "reply_id": str,
    "status": str,
    "task_id": str,
    "principal": str,
    "message_id": str,
    "correlation_id": str,
    "error": str,
    "attempts": int,
    "fence": int,
    "finished_at": (int, float),
    "fingerprint": str,
    "stored_fingerprint": str,
    "traceparent": str,
    "v": int,
}
_KIND_NAMES: dict[type | tuple[type, ...], str] = {
    str: "a string",
    int: "an integer",
    (int, float): "a number",
}


def load_body(body: bytes) -> dict[str, Any]:
    """Decode a reply body as the ingest decodes an envelope (``canonical.loads_strict``:
    UTF-8, no NaN or infinity, no duplicate keys), nesting at most ``REPLY_MAX_DEPTH``.

    Raises:
        BadReply: ``bad_reply``, saying which rule the body breaks.
    """
    try:
        reply = loads_strict(body)
    except RecursionError:
        raise BadReply("bad_reply", f"body nests deeper than {REPLY_MAX_DEPTH} levels") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise BadReply("bad_reply", f"body is not strict UTF-8 JSON: {exc}") from None
    if not isinstance(reply, dict):
        raise BadReply("bad_reply", "body is not a JSON object")
    if body.count(b"{") + body.count(b"[") > REPLY_MAX_DEPTH and _depth(reply) > REPLY_MAX_DEPTH:
        raise BadReply("bad_reply", f"body nests deeper than {REPLY_MAX_DEPTH} levels")
    return reply


def _depth(value: Any) -> int:
    """How many arrays and objects ``value`` nests (walked without recursion). Called only
    when the body has more brackets than the limit: fewer cannot nest deeper."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        deepest = max(deepest, depth)
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return deepest
