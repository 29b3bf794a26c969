"""Canonical JSON: the one encoding of a JSON value, its numbers as every language writes
them, and the strict decoder that reads it back.

Canonical JSON: UTF-8, keys sorted, no insignificant white space, no NaN or infinities,
non-ASCII characters kept as they are. ``canonical_json`` is the only encoder used for
fingerprints, signatures and stored payloads.

For fingerprints numbers are written so that every language gets the same bytes from the
same values (``canonical_numbers``): a float is written the way ECMAScript's
``Number.prototype.toString`` writes the IEEE double (RFC 8785, the JSON Canonicalization
Scheme), so ``13.0``, ``13`` and ``1.3e1`` are one number and ``-0.0`` is ``0``; an integer
is written as its exact decimal digits (the same as ECMAScript's up to 2**53; above that a
Python int keeps every digit, and a float of the same value is written the ECMAScript way,
so the two differ).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

# One encoder and one decoder, built once: ``json.dumps``/``json.loads`` with options build
# a new one on every call, which costs as much as encoding a small payload.
_ENCODER = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


def canonical_json(value: Any) -> bytes:
    """Encode ``value`` as canonical JSON bytes.

    Raises:
        ValueError: the value holds NaN/infinity, a type JSON cannot carry, a string that is
            not encodable as UTF-8 (a lone surrogate), or nests too deeply to encode.
    """
    try:
        text = _ENCODER.encode(value)
    except (TypeError, RecursionError) as exc:
        # json raises TypeError for a set, bytes, a non-str key mix, ...; callers (and the
        # documented contract) expect ValueError for "not JSON".
        raise ValueError(f"not JSON-encodable: {exc}") from None
    return text.encode("utf-8")  # UnicodeEncodeError is a ValueError


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ecmascript_number(value: float) -> str:
    """``value`` as ECMAScript's Number-to-String writes it (RFC 8785 section 3.2.2.3).

    Python's ``repr`` already gives the shortest digits that round-trip (the digits
    ECMAScript picks); only where the decimal point goes and when an exponent is used
    differ: ``1e+21``, ``1e-7``, ``0.000001``, ``100000000000000000000``, ``-0.0`` as ``0``.

    Raises:
        ValueError: ``value`` is NaN or infinite.
    """
    if not math.isfinite(value):
        raise ValueError(f"{value!r} is not a JSON number")
    if value == 0:
        return "0"
    sign = "-" if value < 0 else ""
    mantissa, _, exponent = repr(abs(value)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    shift = int(exponent) if exponent else 0
    if whole == "0":  # 0.00123: the digits start after the zeros of the fraction
        digits = fraction.lstrip("0")
        point = shift - (len(fraction) - len(digits))
    else:
        digits = whole + fraction
        point = shift + len(whole)
    # value == 0.<digits> * 10**point, with k significant digits
    digits = digits.rstrip("0")
    k = len(digits)
    if k <= point <= 21:
        text = digits + "0" * (point - k)
    elif 0 < point <= 21:
        text = digits[:point] + "." + digits[point:]
    elif -6 < point <= 0:
        text = "0." + "0" * -point + digits
    else:
        power = point - 1
        head = digits[0] + ("." + digits[1:] if k > 1 else "")
        text = f"{head}e{'+' if power >= 0 else '-'}{abs(power)}"
    return sign + text


# A float in canonical JSON (Python's repr) always has a digit followed by "." or "e"; an
# integer never does. Python's repr differs from ECMAScript's form only in an integral
# float (``13.0``, ``-0.0``) and in exponents (``1e-05``, ``1e+16``): a plain ``1.5`` or
# ``1796134460.125`` is already written as ECMAScript writes it, so bytes without either
# pattern need no rewrite. Strings are matched as whole tokens so that digits inside them
# are passed over.
_MAYBE_FLOAT = re.compile(rb"[0-9][.eE]")
_MAYBE_REWRITTEN = re.compile(rb"[0-9](?:\.0(?![0-9])|e[-+])")
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|-?[0-9][0-9.eE+-]*')


def _number_token(match: re.Match[bytes]) -> bytes:
    token = match.group()
    if token[0] == 0x22 or not _MAYBE_FLOAT.search(token):  # a string, or an integer
        return token
    return ecmascript_number(float(token)).encode("ascii")


def canonical_numbers(data: bytes) -> bytes:
    """Canonical JSON bytes with every float rewritten by ``ecmascript_number``.

    Bytes without a float that needs it come back as they are, after one scan: the common
    payload (strings, integers, booleans, floats like ``0.25``) costs a regular-expression
    search, not a re-encoding.
    """
    if b"." not in data and b"e+" not in data and b"e-" not in data:
        return data  # no float at all: repr writes a "." or an exponent with its sign
    if _MAYBE_REWRITTEN.search(data) is None:
        return data
    return _JSON_TOKEN.sub(_number_token, data)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads_strict(data: bytes | str) -> Any:
    """Parse JSON, refusing ``NaN``/``Infinity`` and duplicate object keys.

    Raises:
        ValueError: not UTF-8, not JSON, a constant or a duplicate key.
    """
    if not isinstance(data, str):
        data = bytes(data).decode("utf-8")  # json.loads would also sniff UTF-16/32
    return _DECODER.decode(data)


def _no_dup_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
    return obj


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_no_dup_keys)
