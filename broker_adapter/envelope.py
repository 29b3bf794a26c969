"""The task envelope: what an agent sends, validated strictly, with one canonical encoding.

Identity is (authenticated principal, ``message_id``); the principal is never taken from the
body alone (see ``auth``). Two envelopes with the same identity are the *same request* when
their fingerprints match, and a *conflict* otherwise. The fingerprint covers what the request
asks for (``kind``, ``payload``, ``correlation_id``, ``parent_id``), not how it is delivered
(``deadline``, ``max_attempts``, ``hops``), so a resend with a recomputed deadline is still a
duplicate.

Canonical JSON: UTF-8, keys sorted, no insignificant white space, no NaN or infinities,
non-ASCII characters kept as they are. ``canonical_json`` is the only encoder used for
fingerprints, signatures and stored payloads.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from contextvars import ContextVar
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from broker_adapter.errors import EnvelopeError

MESSAGE_ID_MAX_BYTES = 128
PRINCIPAL_MAX_BYTES = 64
PAYLOAD_MAX_BYTES = 64 * 1024
PAYLOAD_MAX_DEPTH = 16
PAYLOAD_MAX_NODES = 10_000
MAX_ATTEMPTS_LIMIT = 10
HOPS_LIMIT = 2**31 - 1
PRINCIPAL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")

Kind = Literal["task", "result", "event"]


def canonical_json(value: Any) -> bytes:
    """Encode ``value`` as canonical JSON bytes.

    Raises:
        ValueError: the value holds NaN/infinity, a type JSON cannot carry, a string that is
            not encodable as UTF-8 (a lone surrogate), or nests too deeply to encode.
    """
    try:
        text = json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, RecursionError) as exc:
        # json raises TypeError for a set, bytes, a non-str key mix, ...; callers (and the
        # documented contract) expect ValueError for "not JSON".
        raise ValueError(f"not JSON-encodable: {exc}") from None
    return text.encode("utf-8")  # UnicodeEncodeError is a ValueError


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads_strict(data: bytes | str) -> Any:
    """Parse JSON, refusing ``NaN``/``Infinity`` and duplicate object keys."""

    def no_dup_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, val in pairs:
            if key in obj:
                raise ValueError(f"duplicate key {key!r}")
            obj[key] = val
        return obj

    return json.loads(data, parse_constant=_reject_constant, object_pairs_hook=no_dup_keys)


def check_payload(payload: Any) -> bytes:
    """Check the payload bounds: object, string keys, finite numbers, depth, nodes, size.

    Returns:
        the payload's canonical JSON bytes (computed for the size check anyway).

    Raises:
        EnvelopeError: with ``field="payload"`` and a specific reason.
    """
    if not isinstance(payload, dict):
        raise EnvelopeError("payload", "not_object", "payload must be a JSON object")
    nodes = 0
    # Iterative walk so that a hostile nesting depth cannot exhaust the Python stack.
    stack: list[tuple[Any, int]] = [(payload, 1)]
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > PAYLOAD_MAX_NODES:
            raise EnvelopeError(
                "payload", "too_many_nodes", f"payload has more than {PAYLOAD_MAX_NODES} nodes"
            )
        kind = type(value)
        if kind is str or kind is int or kind is bool or value is None:
            continue  # the common leaves, without the isinstance chain below
        # Only objects and arrays open a nesting level: 16 nested objects holding a scalar
        # nest 16 levels deep, not 17.
        if depth > PAYLOAD_MAX_DEPTH and isinstance(value, dict | list):
            raise EnvelopeError(
                "payload", "too_deep", f"payload nests deeper than {PAYLOAD_MAX_DEPTH} levels"
            )
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise EnvelopeError(
                        "payload", "non_string_key", f"object key {key!r} is not a string"
                    )
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, bool) or value is None or isinstance(value, str | int):
            continue
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise EnvelopeError("payload", "not_finite", "payload holds NaN or infinity")
        else:
            raise EnvelopeError(
                "payload", "bad_type", f"payload holds a {type(value).__name__}, not JSON"
            )
    try:
        encoded = canonical_json(payload)
        size = len(encoded)
    except UnicodeEncodeError:
        raise EnvelopeError(
            "payload", "bad_utf8", "payload holds a string that is not valid UTF-8"
        ) from None
    if size > PAYLOAD_MAX_BYTES:
        raise EnvelopeError(
            "payload", "too_large", f"payload is {size} bytes canonical, limit {PAYLOAD_MAX_BYTES}"
        )
    return encoded


def _utf8_size(value: str, field: str) -> int:
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise EnvelopeError(field, "bad_utf8", "must be valid UTF-8 (no lone surrogates)") from None


def check_principal(value: str, field: str = "sender") -> str:
    """Validate a principal name (it appears in Redis keys, so its alphabet is small)."""
    size = _utf8_size(value, field)
    if not 1 <= size <= PRINCIPAL_MAX_BYTES:
        raise EnvelopeError(
            field, "bad_length", f"must be 1..{PRINCIPAL_MAX_BYTES} bytes, got {size}"
        )
    if not set(value) <= PRINCIPAL_CHARS:
        raise EnvelopeError(field, "bad_chars", "may hold only letters, digits, '.', '_', '-'")
    return value


# Unicode category Cc exactly: C0 controls, DEL and the C1 controls (U+0080..U+009F).
_CONTROL_CHARS = re.compile("[\x00-\x1f\x7f-\x9f]")


def _check_id(value: str, field: str) -> str:
    size = _utf8_size(value, field)
    if not 1 <= size <= MESSAGE_ID_MAX_BYTES:
        raise EnvelopeError(
            field, "bad_length", f"must be 1..{MESSAGE_ID_MAX_BYTES} UTF-8 bytes, got {size}"
        )
    if _CONTROL_CHARS.search(value):
        raise EnvelopeError(field, "control_char", "must not contain control characters")
    return value


# The canonical bytes computed while validating a payload, handed from the field validator
# to the model validator of the same (synchronous) validation.
_checked_payload: ContextVar[bytes | None] = ContextVar("_checked_payload", default=None)


class Envelope(BaseModel):
    """One request from an agent. Frozen and strict: no coercion, no unknown fields."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    message_id: str
    sender: str
    kind: Kind = "task"
    payload: dict[str, Any]
    deadline: float = Field(description="absolute deadline, epoch seconds")
    max_attempts: int = Field(default=3, ge=1, le=MAX_ATTEMPTS_LIMIT)
    hops: int = Field(default=0, ge=0, le=HOPS_LIMIT)
    correlation_id: str | None = None
    parent_id: str | None = None
    _payload_bytes: tuple[dict[str, Any], bytes] | None = PrivateAttr(default=None)

    @field_validator("message_id")
    @classmethod
    def _message_id(cls, v: str) -> str:
        return _check_id(v, "message_id")

    @field_validator("correlation_id", "parent_id")
    @classmethod
    def _optional_ids(cls, v: str | None, info: Any) -> str | None:
        return None if v is None else _check_id(v, info.field_name)

    @field_validator("sender")
    @classmethod
    def _sender(cls, v: str) -> str:
        return check_principal(v)

    @field_validator("deadline")
    @classmethod
    def _deadline(cls, v: float) -> float:
        if not math.isfinite(v):
            raise EnvelopeError("deadline", "not_finite", "deadline must be a finite number")
        if v <= 0:
            raise EnvelopeError("deadline", "not_positive", "deadline must be after the epoch")
        return v

    # "before": the payload is checked on the raw value, so a non-object or a non-string key
    # gets its specific reason (not_object, non_string_key) rather than a generic type
    # error. The canonical bytes computed for the size check are kept for the fingerprint
    # and the stored copy, so an envelope's payload is encoded once.
    @field_validator("payload", mode="before")
    @classmethod
    def _payload(cls, v: Any) -> Any:
        _checked_payload.set(check_payload(v))
        return v

    @model_validator(mode="after")
    def _keep_payload_bytes(self) -> Envelope:
        encoded = _checked_payload.get()
        if encoded is not None:
            _checked_payload.set(None)
            self._payload_bytes = (self.payload, encoded)
        return self

    # -- construction -------------------------------------------------------------------

    @classmethod
    def build(cls, /, **fields: Any) -> Envelope:
        """Validate ``fields`` into an Envelope.

        Raises:
            EnvelopeError: naming the first offending field and why.
        """
        try:
            return cls.model_validate(fields)
        except ValidationError as exc:
            raise _translate(exc) from None

    @classmethod
    def from_json(cls, data: bytes) -> Envelope:
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
        return cls.build(**raw)

    # -- encodings ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out = self.model_dump()
        return {k: v for k, v in out.items() if v is not None}

    def to_json(self) -> bytes:
        """The canonical wire form."""
        return canonical_json(self.to_dict())

    def content(self) -> dict[str, Any]:
        """The part of the envelope the fingerprint covers."""
        return {
            "kind": self.kind,
            "payload": self.payload,
            "correlation_id": self.correlation_id,
            "parent_id": self.parent_id,
        }

    def payload_bytes(self) -> bytes:
        """The payload's canonical JSON bytes (encoded once per envelope)."""
        cached = self._payload_bytes
        if cached is not None and cached[0] is self.payload:
            return cached[1]
        encoded = canonical_json(self.payload)  # a model_copy(update=...) changed it
        self._payload_bytes = (self.payload, encoded)
        return encoded

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the canonical content: canonical_json(self.content()), with the
        payload's bytes spliced in rather than encoded again (keys in sorted order)."""
        head = canonical_json(
            {"correlation_id": self.correlation_id, "kind": self.kind, "parent_id": self.parent_id}
        )
        return sha256_hex(head[:-1] + b',"payload":' + self.payload_bytes() + b"}")

    def payload_json(self) -> str:
        return self.payload_bytes().decode("utf-8")


def _translate(exc: ValidationError) -> EnvelopeError:
    err = exc.errors()[0]
    loc = err.get("loc", ())
    field = str(loc[0]) if loc else ""
    ctx = err.get("ctx") or {}
    inner = ctx.get("error")
    if isinstance(inner, EnvelopeError):
        return inner
    kind = err.get("type", "invalid")
    reasons = {
        "missing": "missing",
        "extra_forbidden": "unknown_field",
        "literal_error": "bad_value",
        "greater_than_equal": "too_small",
        "less_than_equal": "too_large",
    }
    reason = reasons.get(kind, "bad_type" if kind.endswith("_type") else kind)
    detail = err.get("msg", "invalid")
    if field == "payload" and len(loc) > 1:
        detail = f"{detail} at {'.'.join(str(p) for p in loc[1:])}"
    return EnvelopeError(field, reason, detail)
