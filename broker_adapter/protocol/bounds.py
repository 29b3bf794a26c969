"""The payload and result bounds: a JSON object (a result: any JSON value) of string keys
and finite numbers, at most ``PAYLOAD_MAX_BYTES`` canonical, ``PAYLOAD_MAX_DEPTH`` levels
and ``PAYLOAD_MAX_NODES`` nodes. Each check returns the value's canonical JSON bytes, which
it computes for the size check anyway.
"""

from __future__ import annotations

import math
from typing import Any

from broker_adapter.errors import EnvelopeError
from broker_adapter.protocol.canonical import canonical_json, loads_strict

PAYLOAD_MAX_BYTES = 64 * 1024
PAYLOAD_MAX_DEPTH = 16
PAYLOAD_MAX_NODES = 10_000
#: Integers of more digits are refused: Python neither parses nor writes longer ones (its
#: default int-string limit), so no process of ours could store or answer them.
INT_MAX_DIGITS = 4300


def check_payload(payload: Any) -> bytes:
    """Check the payload bounds: object, string keys, finite numbers, depth, nodes, size.

    Returns:
        the payload's canonical JSON bytes (computed for the size check anyway).

    Raises:
        EnvelopeError: with ``field="payload"`` and a specific reason.
    """
    if not isinstance(payload, dict):
        raise EnvelopeError("payload", "not_object", "payload must be a JSON object")
    _walk(payload, "payload")
    try:
        encoded = canonical_json(payload)
    except UnicodeEncodeError:
        raise EnvelopeError(
            "payload", "bad_utf8", "payload holds a string that is not valid UTF-8"
        ) from None
    except ValueError:  # what is left after the walk: an int Python will not write out
        raise EnvelopeError(
            "payload", "too_large", f"payload holds an integer of more than {INT_MAX_DIGITS} digits"
        ) from None
    _check_size(encoded, "payload")
    return encoded


def _walk(value: Any, field: str) -> None:
    """The walk of ``check_payload``: string keys, JSON types, finite numbers, at most
    ``PAYLOAD_MAX_DEPTH`` levels and ``PAYLOAD_MAX_NODES`` nodes (``field`` names the
    value in the errors)."""
    nodes = 0
    # Iterative walk so that a hostile nesting depth cannot exhaust the Python stack.
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > PAYLOAD_MAX_NODES:
            raise EnvelopeError(
                field, "too_many_nodes", f"{field} has more than {PAYLOAD_MAX_NODES} nodes"
            )
        kind = type(value)
        if kind is str or kind is int or kind is bool or value is None:
            continue  # the common leaves, without the isinstance chain below
        # Only objects and arrays open a nesting level: 16 nested objects holding a scalar
        # nest 16 levels deep, not 17.
        if depth > PAYLOAD_MAX_DEPTH and isinstance(value, dict | list):
            raise EnvelopeError(
                field, "too_deep", f"{field} nests deeper than {PAYLOAD_MAX_DEPTH} levels"
            )
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise EnvelopeError(
                        field, "non_string_key", f"object key {key!r} is not a string"
                    )
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, bool) or value is None or isinstance(value, str | int):
            continue
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise EnvelopeError(field, "not_finite", f"{field} holds NaN or infinity")
        else:
            raise EnvelopeError(
                field, "bad_type", f"{field} holds a {type(value).__name__}, not JSON"
            )


def _check_size(encoded: bytes, field: str) -> None:
    if len(encoded) > PAYLOAD_MAX_BYTES:
        raise EnvelopeError(
            field,
            "too_large",
            f"{field} is {len(encoded)} bytes canonical, limit {PAYLOAD_MAX_BYTES}",
        )


def _within_bounds_by_size(encoded: bytes) -> bool:
    """Whether canonical JSON bytes prove the node and depth limits by themselves: every
    node takes at least one byte of its own, and every nesting level an opening bracket
    (inside strings or not)."""
    return (
        len(encoded) <= PAYLOAD_MAX_NODES
        and encoded.count(b"{") + encoded.count(b"[") <= PAYLOAD_MAX_DEPTH
    )


def check_result(result: Any) -> bytes:
    """Encode a handler's result within the payload bounds: any JSON value (not only an
    object), at most ``PAYLOAD_MAX_BYTES`` canonical, ``PAYLOAD_MAX_DEPTH`` levels and
    ``PAYLOAD_MAX_NODES`` nodes, counted on the JSON the reply carries.

    What ``canonical_json`` takes is a result (a tuple is an array, an int key a string
    key, as in the reply); only its size, depth and nodes are checked here. A result of
    more than 10,000 bytes, or with more than 16 brackets, is parsed back (at most 64 KiB)
    and walked as a payload is.

    Returns:
        the result's canonical JSON bytes.

    Raises:
        ValueError: the result is not JSON (``canonical_json``: NaN, a set, bytes, ...).
        EnvelopeError: with ``field="result"`` and reason ``too_large``, ``too_deep`` or
            ``too_many_nodes`` (an ``EnvelopeError`` is a ``ValueError`` too).
    """
    encoded = canonical_json(result)
    _check_size(encoded, "result")
    if not _within_bounds_by_size(encoded):
        _walk(loads_strict(encoded), "result")
    return encoded


def check_parsed_payload(payload: Any) -> bytes:
    """``check_payload`` for a value ``json`` parsed (the wire path), with the same answers.

    Parsed JSON has string keys and JSON types by construction, so the walk is needed only
    where the encoded bytes cannot prove the bounds by themselves: every node takes at least
    one byte of its own, and every nesting level an opening bracket. A payload that is short
    enough and has few enough brackets (inside strings or not) is within the node and depth
    limits; any other, and any that fails to encode, gets the full walk and its reason.
    """
    if type(payload) is dict:
        try:
            encoded = canonical_json(payload)
        except ValueError:  # infinity (1e400 parses as inf) or a lone surrogate
            return check_payload(payload)
        if len(encoded) <= PAYLOAD_MAX_BYTES and _within_bounds_by_size(encoded):
            return encoded
    return check_payload(payload)
