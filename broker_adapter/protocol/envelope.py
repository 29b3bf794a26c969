"""The task envelope: what an agent sends, validated strictly, with one canonical encoding.

Identity is (authenticated principal, ``message_id``); the principal is never taken from the
body alone (see ``signing``). Two envelopes with the same identity are the *same request* when
their fingerprints match, and a *conflict* otherwise. The fingerprint covers what the request
asks for (``kind``, ``payload``, ``correlation_id``, ``parent_id``, and ``task`` when the
request names one) and the terms it is asked on (``deadline``, ``max_attempts``), not how it
is delivered (``hops``, ``traceparent``): a resend with another deadline is a changed
request, refused as a conflict, while one sent from another trace is still a duplicate.

The request's content is written in canonical JSON (``canonical``) and its payload is kept
within the payload bounds (``bounds``).
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Callable
from json.encoder import encode_basestring
from typing import Any, Literal

from broker_adapter.errors import EnvelopeError
from broker_adapter.protocol.bounds import check_parsed_payload, check_payload
from broker_adapter.protocol.canonical import (
    canonical_json,
    canonical_numbers,
    ecmascript_number,
    loads_strict,
    sha256_hex,
)

MESSAGE_ID_MAX_BYTES = 128
PRINCIPAL_MAX_BYTES = 64
TASK_NAME_MAX_BYTES = 64
MAX_ATTEMPTS_LIMIT = 10
HOPS_LIMIT = 2**31 - 1
PRINCIPAL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")

Kind = Literal["task", "result", "event", "cancel"]


def content_fingerprint(
    kind: str,
    payload: bytes,
    correlation_id: str | None,
    parent_id: str | None,
    *,
    deadline: float,
    max_attempts: int,
    task: str | None = None,
) -> str:
    """SHA-256 (hex) of the canonical content of a request: the canonical JSON of
    ``{"correlation_id", "deadline", "kind", "max_attempts", "parent_id", "payload"}``
    (nulls kept) with its numbers written by ``canonical_numbers`` (the deadline too: a
    ``1900000000.0`` and a ``1900000000`` are one deadline), and ``"task"`` after
    ``payload`` only when the request names one.

    Args:
        payload: the payload's canonical JSON bytes (``Envelope.payload_bytes``, or the
            ``payload`` column of a stored task), spliced in rather than encoded again.
        deadline: the absolute deadline (epoch seconds), a member of the request's terms.
        max_attempts: the attempts the sender allows, a member of its terms too.
        task: the task name (``Envelope.task``), or ``None``.
    """
    head = (
        '{"correlation_id":'
        + _json_str_or_null(correlation_id)
        + ',"deadline":'
        + ecmascript_number(float(deadline))
        + ',"kind":'
        + _json_str_or_null(kind)
        + ',"max_attempts":'
        + str(int(max_attempts))
        + ',"parent_id":'
        + _json_str_or_null(parent_id)
        + ',"payload":'
    )
    tail = b"}" if task is None else (',"task":' + encode_basestring(task) + "}").encode("utf-8")
    return sha256_hex(head.encode("utf-8") + canonical_numbers(payload) + tail)


def _utf8_size(value: str, field: str) -> int:
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise EnvelopeError(field, "bad_utf8", "must be valid UTF-8 (no lone surrogates)") from None


def check_principal(value: str, field: str = "sender") -> str:
    """Validate a principal name (it appears in Redis keys, so its alphabet is small)."""
    if _PRINCIPAL.fullmatch(value):
        return value  # the common case in one step; the checks below say what is wrong
    size = _utf8_size(value, field)
    if not 1 <= size <= PRINCIPAL_MAX_BYTES:
        raise EnvelopeError(
            field, "bad_length", f"must be 1..{PRINCIPAL_MAX_BYTES} bytes, got {size}"
        )
    if not set(value) <= PRINCIPAL_CHARS:
        raise EnvelopeError(field, "bad_chars", "may hold only letters, digits, '.', '_', '-'")
    return value


_PRINCIPAL = re.compile(f"[A-Za-z0-9._-]{{1,{PRINCIPAL_MAX_BYTES}}}")
_TASK_NAME = re.compile(f"[A-Za-z0-9._:-]{{1,{TASK_NAME_MAX_BYTES}}}")


def check_task_name(value: Any, field: str = "task") -> str | None:
    """Validate an optional task name (``None`` passes): 1..64 bytes of letters, digits,
    ``.``, ``_``, ``-`` and ``:``.

    Raises:
        EnvelopeError: ``bad_type``, ``bad_length`` or ``bad_chars``.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise _type_error(field, "a string", value)
    if _TASK_NAME.fullmatch(value):
        return value
    size = _utf8_size(value, field)
    if not 1 <= size <= TASK_NAME_MAX_BYTES:
        raise EnvelopeError(
            field, "bad_length", f"must be 1..{TASK_NAME_MAX_BYTES} bytes, got {size}"
        )
    raise EnvelopeError(field, "bad_chars", "may hold only letters, digits, '.', '_', '-', ':'")


# Unicode category Cc exactly: C0 controls, DEL and the C1 controls (U+0080..U+009F).
_CONTROL_CHARS = re.compile("[\x00-\x1f\x7f-\x9f]")


def _check_id(value: str, field: str) -> str:
    size = len(value) if value.isascii() else _utf8_size(value, field)
    if not 1 <= size <= MESSAGE_ID_MAX_BYTES:
        raise EnvelopeError(
            field, "bad_length", f"must be 1..{MESSAGE_ID_MAX_BYTES} UTF-8 bytes, got {size}"
        )
    if _CONTROL_CHARS.search(value):
        raise EnvelopeError(field, "control_char", "must not contain control characters")
    if not value.isascii():
        for char in value:
            if unicodedata.category(char) in _INVISIBLE_CATEGORIES:
                raise EnvelopeError(
                    field,
                    "format_char",
                    f"must not contain format or line/paragraph separator characters "
                    f"(U+{ord(char):04X})",
                )
    return value


#: Unicode format characters (Cf: bidirectional overrides such as U+202E, zero-width
#: characters) and the line and paragraph separators (Zl U+2028, Zp U+2029): an id holding
#: one prints as another id, or breaks a log line.
_INVISIBLE_CATEGORIES = frozenset({"Cf", "Zl", "Zp"})


_FIELDS = (
    "message_id",
    "sender",
    "kind",
    "payload",
    "deadline",
    "max_attempts",
    "hops",
    "correlation_id",
    "parent_id",
    "traceparent",
    "task",
)
_REQUIRED = frozenset({"message_id", "sender", "payload", "deadline"})
_KINDS: tuple[Kind, ...] = ("task", "result", "event", "cancel")


def _type_error(field: str, expected: str, value: Any) -> EnvelopeError:
    return EnvelopeError(field, "bad_type", f"must be {expected}, got {type(value).__name__}")


def _check_str(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise _type_error(field, "a string", value)
    return value


def _check_int(value: Any, field: str, low: int, high: int) -> int:
    # Strict: a bool is not an int here, nor is 1.0 or "1".
    if type(value) is not int and (not isinstance(value, int) or isinstance(value, bool)):
        raise _type_error(field, "an integer", value)
    if value < low:
        raise EnvelopeError(field, "too_small", f"must be >= {low}, got {value}")
    if value > high:
        raise EnvelopeError(field, "too_large", f"must be <= {high}, got {value}")
    return int(value)


def _check_deadline(value: Any) -> float:
    if type(value) is not float and (not isinstance(value, int | float) or isinstance(value, bool)):
        raise _type_error("deadline", "a number (epoch seconds)", value)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise EnvelopeError("deadline", "not_finite", "deadline must be a finite number")
    if number <= 0:
        raise EnvelopeError("deadline", "not_positive", "deadline must be after the epoch")
    return number


def _check_optional_id(value: Any, field: str) -> str | None:
    return None if value is None else _check_id(_check_str(value, field), field)


#: A W3C trace context ``traceparent`` of version 00: lowercase hex, trace id and parent
#: (span) id not all zeros (the values the standard calls invalid).
_TRACEPARENT = re.compile("00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


def check_traceparent(value: Any, field: str = "traceparent") -> str | None:
    """Validate an optional W3C trace context ``traceparent`` (``None`` passes).

    Strict: only version ``00`` in its exact form, ``00-<32 hex>-<16 hex>-<2 hex>`` in
    lowercase (55 characters), trace id and parent id not all zeros.

    Raises:
        EnvelopeError: ``bad_type`` (not a string) or ``bad_value``.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise _type_error(field, "a string", value)
    if len(value) != 55 or _TRACEPARENT.fullmatch(value) is None:
        raise EnvelopeError(
            field,
            "bad_value",
            "must be a W3C traceparent 00-<32 hex>-<16 hex>-<2 hex> in lowercase,"
            " trace id and parent id not all zeros",
        )
    return value


def _check_kind(value: Any) -> Kind:
    if isinstance(value, str):
        for kind in _KINDS:
            if value == kind:
                return kind
    raise EnvelopeError("kind", "bad_value", f"must be one of {', '.join(_KINDS)}; got {value!r}")


class Envelope:
    """One request from an agent. Frozen and strict: no coercion, no unknown fields.

    Build one with ``Envelope.build(**fields)`` (or ``Envelope(...)``, the same checks) or
    parse the wire form with ``Envelope.from_json``; both raise ``EnvelopeError`` naming
    the first offending field (in the order below) and why.

    Attributes:
        message_id: the sender's stable id for this request (1..128 UTF-8 bytes).
        sender: the principal the sender claims to be (checked against its signature).
        kind: ``task`` (becomes work), ``cancel`` (cancels the sender's request named by
            ``payload["message_id"]``), ``result`` or ``event`` (refused as work).
        payload: a JSON object within the payload bounds.
        deadline: absolute deadline, epoch seconds (an int is kept as a float).
        max_attempts: 1..10.
        hops: how many hand-offs led here, as the sender counts them (0..2**31-1).
        correlation_id: the sender's conversation id, echoed in the reply.
        parent_id: the task this request was made on behalf of.
        traceparent: the W3C trace context the request was sent in (``check_traceparent``);
            carried into its reply and the adapter's spans, not part of the fingerprint.
        task: the name of the task asked for (``check_task_name``), routed by the adapter's
            ``Router``; ``None``: its default handler. Part of the fingerprint when given.
    """

    __slots__ = (*_FIELDS, "_payload_bytes")

    message_id: str
    sender: str
    kind: Kind
    payload: dict[str, Any]
    deadline: float
    max_attempts: int
    hops: int
    correlation_id: str | None
    parent_id: str | None
    traceparent: str | None
    task: str | None
    _payload_bytes: bytes

    def __init__(
        self,
        *,
        message_id: str,
        sender: str,
        payload: dict[str, Any],
        deadline: float,
        kind: Kind = "task",
        max_attempts: int = 3,
        hops: int = 0,
        correlation_id: str | None = None,
        parent_id: str | None = None,
        traceparent: str | None = None,
        task: str | None = None,
        _payload_check: Callable[[Any], bytes] = check_payload,
    ) -> None:
        # ``_payload_check`` is internal: ``from_json`` passes the wire fast path. Field
        # dicts cannot reach it (``_build`` refuses names outside ``_FIELDS``).
        # Checked in the order of ``_FIELDS``: the first offending field is the one named.
        put = object.__setattr__
        put(self, "message_id", _check_id(_check_str(message_id, "message_id"), "message_id"))
        put(self, "sender", check_principal(_check_str(sender, "sender")))
        put(self, "kind", _check_kind(kind))
        # The canonical bytes computed for the size check are kept for the fingerprint and
        # the stored copy, so an envelope's payload is encoded once.
        put(self, "_payload_bytes", _payload_check(payload))
        put(self, "payload", payload)
        put(self, "deadline", _check_deadline(deadline))
        put(self, "max_attempts", _check_int(max_attempts, "max_attempts", 1, MAX_ATTEMPTS_LIMIT))
        put(self, "hops", _check_int(hops, "hops", 0, HOPS_LIMIT))
        put(self, "correlation_id", _check_optional_id(correlation_id, "correlation_id"))
        put(self, "parent_id", _check_optional_id(parent_id, "parent_id"))
        put(self, "traceparent", check_traceparent(traceparent))
        put(self, "task", check_task_name(task))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Envelope is frozen: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Envelope is frozen: cannot delete {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Envelope):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in _FIELDS)

    def __hash__(self) -> int:
        return hash((self.message_id, self.sender, self.fingerprint()))

    def __repr__(self) -> str:
        inner = ", ".join(f"{f}={getattr(self, f)!r}" for f in _FIELDS)
        return f"Envelope({inner})"

    def __reduce__(self) -> tuple[Any, ...]:
        # pickle and copy rebuild through the checks (the frozen __setattr__ refuses the
        # default slot-by-slot restore)
        return (_rebuild, (self.to_dict(),))

    # -- construction -------------------------------------------------------------------

    @classmethod
    def build(cls, /, **fields: Any) -> Envelope:
        """Validate ``fields`` into an Envelope.

        Raises:
            EnvelopeError: naming the first offending field and why (``missing`` and
                ``unknown_field`` included).
        """
        return cls._build(fields, check_payload)

    @classmethod
    def _build(cls, fields: dict[str, Any], payload_check: Callable[[Any], bytes]) -> Envelope:
        keys = fields.keys()
        if not keys >= _REQUIRED:
            missing = next(name for name in _FIELDS if name in _REQUIRED and name not in keys)
            raise EnvelopeError(missing, "missing", "field required")
        if not keys <= _FIELD_SET:
            extra = next(k for k in fields if k not in _FIELD_SET)
            raise EnvelopeError(str(extra), "unknown_field", "not a field of the envelope")
        return cls(**fields, _payload_check=payload_check)

    def replace(self, **changes: Any) -> Envelope:
        """A copy with ``changes`` applied, checked like ``build``."""
        return Envelope.build(**(self.to_dict() | changes))

    @classmethod
    def from_json(cls, data: bytes | str) -> Envelope:
        """Parse the wire form (canonical JSON bytes of ``to_dict()``).

        Raises:
            EnvelopeError: the bytes are not UTF-8 JSON, not an object, or not a valid envelope.
        """
        if isinstance(data, bytes | bytearray | memoryview):
            try:
                # Strict UTF-8: json.loads(bytes) would also sniff UTF-16/32 and a BOM.
                text = bytes(data).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise EnvelopeError("", "not_utf8", f"envelope is not UTF-8: {exc}") from None
        else:
            text = data
        try:
            raw = loads_strict(text)
        except (ValueError, RecursionError) as exc:
            raise EnvelopeError("", "unparseable", f"envelope is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise EnvelopeError("", "not_object", "envelope must be a JSON object")
        return cls._build(raw, check_parsed_payload)

    # -- encodings ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The fields, without those that are ``None``."""
        out: dict[str, Any] = {}
        for name in _FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def to_json(self) -> bytes:
        """The canonical wire form."""
        return canonical_json(self.to_dict())

    def content(self) -> dict[str, Any]:
        """The part of the envelope the fingerprint covers (``task`` only when given)."""
        out = {
            "kind": self.kind,
            "payload": self.payload,
            "correlation_id": self.correlation_id,
            "parent_id": self.parent_id,
            "deadline": self.deadline,
            "max_attempts": self.max_attempts,
        }
        if self.task is not None:
            out["task"] = self.task
        return out

    def payload_bytes(self) -> bytes:
        """The payload's canonical JSON bytes (encoded once, when the envelope was checked).

        The payload dict is the caller's: mutating it after the build is not seen here.
        """
        return self._payload_bytes

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the canonical content, ``canonical_json(self.content())`` with
        its floats written the ECMAScript way (``content_fingerprint``)."""
        return content_fingerprint(
            self.kind,
            self._payload_bytes,
            self.correlation_id,
            self.parent_id,
            deadline=self.deadline,
            max_attempts=self.max_attempts,
            task=self.task,
        )

    def payload_json(self) -> str:
        return self._payload_bytes.decode("utf-8")


_FIELD_SET = frozenset(_FIELDS)


def _rebuild(fields: dict[str, Any]) -> Envelope:
    return Envelope.build(**fields)


def _json_str_or_null(value: str | None) -> str:
    """The canonical JSON of a string or ``None`` (as ``canonical_json`` writes it)."""
    return "null" if value is None else encode_basestring(value)
