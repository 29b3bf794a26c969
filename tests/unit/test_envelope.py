"""The envelope: every bound, both sides of every edge, a specific reason for each refusal."""

from __future__ import annotations

import copy
import json
import math
import pickle
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker_adapter.errors import EnvelopeError
from broker_adapter.protocol.bounds import (
    INT_MAX_DIGITS,
    PAYLOAD_MAX_BYTES,
    PAYLOAD_MAX_DEPTH,
    PAYLOAD_MAX_NODES,
    check_parsed_payload,
    check_payload,
    check_result,
)
from broker_adapter.protocol.canonical import (
    canonical_json,
    canonical_numbers,
    ecmascript_number,
    loads_strict,
    sha256_hex,
)
from broker_adapter.protocol.envelope import (
    HOPS_LIMIT,
    MAX_ATTEMPTS_LIMIT,
    MESSAGE_ID_MAX_BYTES,
    PRINCIPAL_MAX_BYTES,
    Envelope,
    content_fingerprint,
)
from broker_adapter.store import AcceptItem, TaskStore, open_database
from tests.support.store_script import T0, dump

MISSING = object()


def fields(**overrides: Any) -> dict[str, Any]:
    """A valid envelope's fields; ``MISSING`` drops one."""
    base: dict[str, Any] = {
        "message_id": "m-1",
        "sender": "alice",
        "payload": {"q": "hello"},
        "deadline": T0 + 60,
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not MISSING}


def nested(levels: int) -> dict[str, Any]:
    """``levels`` nested objects, the innermost holding a scalar."""
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(levels - 1):
        value = {"n": value}
    return value


def nested_lists(levels: int) -> dict[str, Any]:
    """An object holding ``levels - 1`` nested arrays, the innermost holding a scalar."""
    value: Any = [1]
    for _ in range(levels - 2):
        value = [value]
    return {"l": value}


def sized(total: int, char: str = "x") -> dict[str, Any]:
    """A payload whose canonical encoding is exactly ``total`` bytes."""
    overhead = len(canonical_json({"a": ""}))
    width = len(char.encode("utf-8"))
    count, rest = divmod(total - overhead, width)
    value = {"a": char * count + "y" * rest}
    assert len(canonical_json(value)) == total
    return value


# (id, overrides, field, reason): each must be refused with exactly this field and reason.
INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    # message_id: 1..128 UTF-8 bytes, no control characters, a string
    ("message_id_empty", {"message_id": ""}, "message_id", "bad_length"),
    ("message_id_129_ascii", {"message_id": "a" * 129}, "message_id", "bad_length"),
    ("message_id_129_bytes_2byte", {"message_id": "é" * 64 + "a"}, "message_id", "bad_length"),
    ("message_id_129_bytes_3byte", {"message_id": "€" * 43}, "message_id", "bad_length"),
    ("message_id_132_bytes_4byte", {"message_id": "😀" * 33}, "message_id", "bad_length"),
    ("message_id_nul", {"message_id": "a\x00b"}, "message_id", "control_char"),
    ("message_id_newline", {"message_id": "a\nb"}, "message_id", "control_char"),
    ("message_id_us_0x1f", {"message_id": "a\x1f"}, "message_id", "control_char"),
    ("message_id_del", {"message_id": "a\x7f"}, "message_id", "control_char"),
    ("message_id_c1_nel", {"message_id": "a\x85"}, "message_id", "control_char"),
    ("message_id_lone_surrogate", {"message_id": "a\ud800"}, "message_id", "bad_utf8"),
    ("message_id_int", {"message_id": 1}, "message_id", "bad_type"),
    ("message_id_bytes", {"message_id": b"m"}, "message_id", "bad_type"),
    ("message_id_none", {"message_id": None}, "message_id", "bad_type"),
    ("message_id_missing", {"message_id": MISSING}, "message_id", "missing"),
    # sender: 1..64 bytes of [A-Za-z0-9._-]
    ("sender_empty", {"sender": ""}, "sender", "bad_length"),
    ("sender_65", {"sender": "a" * 65}, "sender", "bad_length"),
    ("sender_66_bytes_multibyte", {"sender": "é" * 33}, "sender", "bad_length"),
    ("sender_space", {"sender": "al ice"}, "sender", "bad_chars"),
    ("sender_colon", {"sender": "a:b"}, "sender", "bad_chars"),
    ("sender_slash", {"sender": "a/b"}, "sender", "bad_chars"),
    ("sender_non_ascii_letter", {"sender": "é"}, "sender", "bad_chars"),
    ("sender_lone_surrogate", {"sender": "\udfff"}, "sender", "bad_utf8"),
    ("sender_int", {"sender": 7}, "sender", "bad_type"),
    ("sender_missing", {"sender": MISSING}, "sender", "missing"),
    # kind: a literal
    ("kind_capitalised", {"kind": "Task"}, "kind", "bad_value"),
    ("kind_empty", {"kind": ""}, "kind", "bad_value"),
    ("kind_other", {"kind": "command"}, "kind", "bad_value"),
    ("kind_int", {"kind": 1}, "kind", "bad_value"),
    # payload: an object with string keys, JSON values, finite numbers, bounded
    ("payload_list", {"payload": [1]}, "payload", "not_object"),
    ("payload_string", {"payload": "x"}, "payload", "not_object"),
    ("payload_none", {"payload": None}, "payload", "not_object"),
    ("payload_missing", {"payload": MISSING}, "payload", "missing"),
    ("payload_depth_17", {"payload": nested(PAYLOAD_MAX_DEPTH + 1)}, "payload", "too_deep"),
    ("payload_depth_17_lists", {"payload": nested_lists(17)}, "payload", "too_deep"),
    ("payload_depth_17_empty", {"payload": nested(16) | {"e": nested(16)}}, "payload", "too_deep"),
    ("payload_10001_nodes", {"payload": {"a": [0] * 9_999}}, "payload", "too_many_nodes"),
    ("payload_65537_bytes", {"payload": sized(PAYLOAD_MAX_BYTES + 1)}, "payload", "too_large"),
    (
        "payload_65537_bytes_multibyte",
        {"payload": sized(PAYLOAD_MAX_BYTES + 1, "é")},
        "payload",
        "too_large",
    ),
    ("payload_nan", {"payload": {"a": math.nan}}, "payload", "not_finite"),
    ("payload_inf_nested", {"payload": {"a": [1.0, math.inf]}}, "payload", "not_finite"),
    ("payload_minus_inf", {"payload": {"a": {"b": -math.inf}}}, "payload", "not_finite"),
    ("payload_int_key", {"payload": {1: "a"}}, "payload", "non_string_key"),
    ("payload_none_key_nested", {"payload": {"a": {None: 1}}}, "payload", "non_string_key"),
    ("payload_tuple", {"payload": {"a": (1, 2)}}, "payload", "bad_type"),
    ("payload_set", {"payload": {"a": {1, 2}}}, "payload", "bad_type"),
    ("payload_bytes", {"payload": {"a": b"x"}}, "payload", "bad_type"),
    ("payload_decimal", {"payload": {"a": Decimal("1.5")}}, "payload", "bad_type"),
    ("payload_complex", {"payload": {"a": 1j}}, "payload", "bad_type"),
    ("payload_object", {"payload": {"a": [object()]}}, "payload", "bad_type"),
    ("payload_lone_surrogate_value", {"payload": {"a": "\ud800"}}, "payload", "bad_utf8"),
    ("payload_lone_surrogate_key", {"payload": {"\udc00": 1}}, "payload", "bad_utf8"),
    # deadline: finite, > 0, a number (not a string, not a bool)
    ("deadline_zero", {"deadline": 0}, "deadline", "not_positive"),
    ("deadline_zero_float", {"deadline": 0.0}, "deadline", "not_positive"),
    ("deadline_negative", {"deadline": -5e-324}, "deadline", "not_positive"),
    ("deadline_nan", {"deadline": math.nan}, "deadline", "not_finite"),
    ("deadline_inf", {"deadline": math.inf}, "deadline", "not_finite"),
    ("deadline_minus_inf", {"deadline": -math.inf}, "deadline", "not_finite"),
    ("deadline_string", {"deadline": "1800000000"}, "deadline", "bad_type"),
    ("deadline_bool", {"deadline": True}, "deadline", "bad_type"),
    ("deadline_none", {"deadline": None}, "deadline", "bad_type"),
    ("deadline_missing", {"deadline": MISSING}, "deadline", "missing"),
    # max_attempts: 1..10, an int (not a bool, a float or a string)
    ("max_attempts_0", {"max_attempts": 0}, "max_attempts", "too_small"),
    ("max_attempts_11", {"max_attempts": MAX_ATTEMPTS_LIMIT + 1}, "max_attempts", "too_large"),
    ("max_attempts_true", {"max_attempts": True}, "max_attempts", "bad_type"),
    ("max_attempts_false", {"max_attempts": False}, "max_attempts", "bad_type"),
    ("max_attempts_float", {"max_attempts": 1.0}, "max_attempts", "bad_type"),
    ("max_attempts_string", {"max_attempts": "1"}, "max_attempts", "bad_type"),
    # hops: 0..2**31-1, an int
    ("hops_negative", {"hops": -1}, "hops", "too_small"),
    ("hops_2_31", {"hops": HOPS_LIMIT + 1}, "hops", "too_large"),
    ("hops_bool", {"hops": True}, "hops", "bad_type"),
    ("hops_string", {"hops": "0"}, "hops", "bad_type"),
    ("hops_float", {"hops": 0.0}, "hops", "bad_type"),
    # correlation_id / parent_id: like message_id, or absent/None
    ("correlation_id_empty", {"correlation_id": ""}, "correlation_id", "bad_length"),
    ("correlation_id_129", {"correlation_id": "c" * 129}, "correlation_id", "bad_length"),
    ("correlation_id_control", {"correlation_id": "c\t"}, "correlation_id", "control_char"),
    ("correlation_id_int", {"correlation_id": 5}, "correlation_id", "bad_type"),
    ("parent_id_empty", {"parent_id": ""}, "parent_id", "bad_length"),
    ("parent_id_129_bytes", {"parent_id": "é" * 64 + "p"}, "parent_id", "bad_length"),
    ("parent_id_control", {"parent_id": "\x00"}, "parent_id", "control_char"),
    ("parent_id_list", {"parent_id": ["p"]}, "parent_id", "bad_type"),
    # unknown fields: nothing the schema does not name
    ("unknown_principal", {"principal": "mallory"}, "principal", "unknown_field"),
    ("unknown_extra", {"extra": 1}, "extra", "unknown_field"),
    ("unknown_cls", {"cls": 1}, "cls", "unknown_field"),
    # the constructor's internal payload-check hook is not a field: no caller of build or
    # from_json can swap the payload checks out
    ("unknown_internal_hook", {"_payload_check": "x"}, "_payload_check", "unknown_field"),
]

# (id, overrides): the largest (or smallest) value that is still valid, next to each edge.
VALID_EDGES: list[tuple[str, dict[str, Any]]] = [
    ("message_id_1", {"message_id": "m"}),
    ("message_id_128_ascii", {"message_id": "a" * MESSAGE_ID_MAX_BYTES}),
    ("message_id_128_bytes_2byte", {"message_id": "é" * 64}),
    ("message_id_128_bytes_3byte", {"message_id": "€" * 42 + "ab"}),
    ("message_id_128_bytes_4byte", {"message_id": "😀" * 32}),
    ("message_id_space_and_tilde", {"message_id": " ~ "}),
    ("message_id_non_control_unicode", {"message_id": "a\u00a0b\u00e9"}),
    ("sender_1", {"sender": "a"}),
    ("sender_64", {"sender": "a" * PRINCIPAL_MAX_BYTES}),
    ("sender_full_alphabet", {"sender": "AZaz09._-"}),
    ("kind_result", {"kind": "result"}),
    ("kind_event", {"kind": "event"}),
    ("payload_empty", {"payload": {}}),
    ("payload_depth_16", {"payload": nested(PAYLOAD_MAX_DEPTH)}),
    ("payload_depth_16_lists", {"payload": nested_lists(16)}),
    ("payload_10000_nodes", {"payload": {"a": [0] * (PAYLOAD_MAX_NODES - 2)}}),
    ("payload_65536_bytes", {"payload": sized(PAYLOAD_MAX_BYTES)}),
    ("payload_65536_bytes_multibyte", {"payload": sized(PAYLOAD_MAX_BYTES, "é")}),
    ("payload_largest_float", {"payload": {"a": 1.7976931348623157e308, "b": -5e-324}}),
    ("payload_big_int", {"payload": {"a": 2**100, "b": None, "c": True}}),
    ("deadline_smallest_positive", {"deadline": 5e-324}),
    ("deadline_largest_float", {"deadline": 1.7976931348623157e308}),
    ("deadline_int", {"deadline": 1_900_000_000}),
    ("max_attempts_1", {"max_attempts": 1}),
    ("max_attempts_10", {"max_attempts": MAX_ATTEMPTS_LIMIT}),
    ("hops_0", {"hops": 0}),
    ("hops_2_31_minus_1", {"hops": HOPS_LIMIT}),
    ("correlation_id_128", {"correlation_id": "c" * 128}),
    ("correlation_id_none", {"correlation_id": None}),
    ("parent_id_128_bytes", {"parent_id": "é" * 64}),
]


def round_trips_as_json(value: dict[str, Any]) -> bool:
    """True when the fields survive JSON unchanged (so the wire path sees the same input)."""
    try:
        encoded = canonical_json(value)
    except (ValueError, TypeError):  # TypeError: keep collection alive if the contract breaks
        return False
    decoded = json.loads(encoded)
    return bool(decoded == value) and json.dumps(decoded, sort_keys=True) == json.dumps(
        value, sort_keys=True
    )


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [pytest.param(o, f, r, id=i) for i, o, f, r in INVALID],
)
def test_envelope_build_rejects_with_specific_field_and_reason(
    overrides: dict[str, Any], field: str, reason: str
) -> None:
    with pytest.raises(EnvelopeError) as info:
        Envelope.build(**fields(**overrides))
    assert (info.value.field, info.value.reason) == (field, reason), info.value.detail
    assert info.value.detail
    assert field in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [pytest.param(o, f, r, id=i) for i, o, f, r in INVALID if round_trips_as_json(fields(**o))],
)
def test_envelope_from_json_rejects_with_same_field_and_reason(
    overrides: dict[str, Any], field: str, reason: str
) -> None:
    with pytest.raises(EnvelopeError) as info:
        Envelope.from_json(canonical_json(fields(**overrides)))
    assert (info.value.field, info.value.reason) == (field, reason)


def test_envelope_invalid_table_covers_the_wire_path_for_most_cases() -> None:
    wire = [i for i, o, _, _ in INVALID if round_trips_as_json(fields(**o))]
    assert len(wire) >= 50
    assert "unknown_cls" in wire


@pytest.mark.parametrize("overrides", [pytest.param(o, id=i) for i, o in VALID_EDGES])
def test_envelope_build_accepts_the_value_at_each_edge(overrides: dict[str, Any]) -> None:
    env = Envelope.build(**fields(**overrides))
    for name, value in overrides.items():
        assert getattr(env, name) == value
    again = Envelope.from_json(env.to_json())
    assert again == env
    assert again.fingerprint() == env.fingerprint()


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [pytest.param(o, f, r, id=i) for i, o, f, r in INVALID[::4]],
)
def test_task_store_accept_writes_nothing_when_envelope_is_invalid(
    overrides: dict[str, Any], field: str, reason: str, tmp_path: Path
) -> None:
    with open_database(tmp_path / "s.db") as db:
        tasks = TaskStore(db)
        before = dump(db)
        with pytest.raises(EnvelopeError) as info:
            tasks.accept([AcceptItem("alice", Envelope.build(**fields(**overrides)))])
        assert (info.value.field, info.value.reason) == (field, reason)
        assert dump(db) == before
        assert tasks.counts()["pending"] == 0


def test_envelope_deadline_int_is_stored_as_float() -> None:
    env = Envelope.build(**fields(deadline=1_900_000_000))
    assert isinstance(env.deadline, float)
    assert env.to_dict()["deadline"] == 1_900_000_000.0


def test_envelope_is_frozen() -> None:
    env = Envelope.build(**fields())
    with pytest.raises(AttributeError, match="frozen"):
        env.message_id = "other"
    with pytest.raises(AttributeError, match="frozen"):
        del env.payload
    assert env.message_id == "m-1"


def test_envelope_pickles_and_copies_as_an_equal_envelope() -> None:
    env = Envelope.build(**fields(payload={"a": [1, {"b": None}]}, correlation_id="c"))
    for twin in (pickle.loads(pickle.dumps(env)), copy.deepcopy(env), copy.copy(env)):
        assert twin == env
        assert twin.fingerprint() == env.fingerprint()
        assert twin.payload_bytes() == env.payload_bytes()


def test_envelope_constructor_checks_like_build() -> None:
    assert Envelope(**fields()) == Envelope.build(**fields())
    with pytest.raises(EnvelopeError) as info:
        Envelope(**fields(max_attempts=0))
    assert (info.value.field, info.value.reason) == ("max_attempts", "too_small")


def test_envelope_replace_checks_the_copy() -> None:
    env = Envelope.build(**fields())
    other = env.replace(sender="bob")
    assert (other.sender, other.message_id, env.sender) == ("bob", env.message_id, "alice")
    with pytest.raises(EnvelopeError) as info:
        env.replace(sender="b b")
    assert (info.value.field, info.value.reason) == ("sender", "bad_chars")


def test_envelope_fingerprint_is_the_hash_of_canonical_content() -> None:
    for extra in (
        {},
        {"correlation_id": 'c-\u00e9"q'},
        {"parent_id": "p\u00a0\u4e2d", "payload": {"q": "p\u2028\u202e"}},
        {"kind": "event"},
    ):
        env = Envelope.build(**fields(**extra))
        # the deadline is a float: written the ECMAScript way, like the payload's numbers
        assert env.fingerprint() == sha256_hex(canonical_numbers(canonical_json(env.content())))


# -- the wire form --------------------------------------------------------------------------

GARBAGE: list[tuple[str, bytes, str]] = [
    ("empty", b"", "unparseable"),
    ("text", b"hello", "unparseable"),
    ("truncated", b'{"message_id": "m"', "unparseable"),
    ("trailing_garbage", b'{"a": 1} x', "unparseable"),
    ("nan_literal", b'{"payload": {"a": NaN}}', "unparseable"),
    ("infinity_literal", b'{"payload": {"a": Infinity}}', "unparseable"),
    ("minus_infinity_literal", b'{"deadline": -Infinity}', "unparseable"),
    ("duplicate_top_key", b'{"message_id": "a", "message_id": "b"}', "unparseable"),
    ("duplicate_payload_key", b'{"payload": {"a": 1, "a": 1}}', "unparseable"),
    ("deep_arrays_100000", b"[" * 100_000 + b"]" * 100_000, "unparseable"),
    ("deep_objects_100000", b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "unparseable"),
    ("deep_unclosed_100000", b'{"payload":' + b"[" * 100_000, "unparseable"),
    ("huge_int_literal", b'{"hops": 1' + b"0" * 5000 + b"}", "unparseable"),
    ("utf8_bom", b'\xef\xbb\xbf{"message_id": "m"}', "unparseable"),
    ("invalid_byte", b'{"message_id": "\xff"}', "not_utf8"),
    ("truncated_multibyte", b'{"message_id": "\xc3"}', "not_utf8"),
    ("overlong_encoding", b'{"message_id": "\xc0\xaf"}', "not_utf8"),
    ("encoded_surrogate", b'{"message_id": "\xed\xa0\x80"}', "not_utf8"),
    ("latin1", '{"message_id": "café"}'.encode("latin-1"), "not_utf8"),
    ("utf16_with_bom", '{"message_id": "m"}'.encode("utf-16"), "not_utf8"),
    # UTF-16-LE of ASCII text is valid UTF-8 (with NULs), so it fails as JSON instead.
    ("utf16_le", '{"message_id": "m"}'.encode("utf-16-le"), "unparseable"),
    ("utf32", '{"message_id": "m"}'.encode("utf-32"), "not_utf8"),
    ("array", b"[1, 2]", "not_object"),
    ("string", b'"envelope"', "not_object"),
    ("number", b"42", "not_object"),
    ("null", b"null", "not_object"),
]


@pytest.mark.parametrize(("data", "reason"), [pytest.param(d, r, id=i) for i, d, r in GARBAGE])
def test_envelope_from_json_rejects_garbage_with_envelope_error(data: bytes, reason: str) -> None:
    with pytest.raises(EnvelopeError) as info:
        Envelope.from_json(data)
    assert (info.value.field, info.value.reason) == ("", reason), info.value.detail


@pytest.mark.parametrize(
    ("key", "raw", "field", "reason"),
    [
        ("max_attempts", '"1"', "max_attempts", "bad_type"),
        ("max_attempts", "true", "max_attempts", "bad_type"),
        ("hops", "1.0", "hops", "bad_type"),
        ("deadline", '"1800000060"', "deadline", "bad_type"),
        ("deadline", "1e400", "deadline", "not_finite"),
        ("correlation_id", '"\\ud800"', "correlation_id", "bad_utf8"),
        ("parent_id", '"a\\u0000b"', "parent_id", "control_char"),
        ("kind", "null", "kind", "bad_value"),
    ],
)
def test_envelope_from_json_is_strict_about_types(
    key: str, raw: str, field: str, reason: str
) -> None:
    members = {"message_id": '"m"', "sender": '"a"', "payload": "{}", "deadline": "1800000060"}
    members[key] = raw
    data = "{" + ", ".join(f'"{k}": {v}' for k, v in members.items()) + "}"
    with pytest.raises(EnvelopeError) as info:
        Envelope.from_json(data.encode("utf-8"))
    assert (info.value.field, info.value.reason) == (field, reason)


def test_envelope_json_round_trip_is_canonical_and_omits_none() -> None:
    env = Envelope.build(**fields(payload={"b": 1, "a": "é"}, correlation_id="c1"))
    data = env.to_json()
    assert data == canonical_json(env.to_dict())
    assert b" " not in data
    assert "é".encode() in data  # non-ASCII kept as is, not \u-escaped
    assert b"parent_id" not in data
    assert data.index(b'"a"') < data.index(b'"b"')
    assert Envelope.from_json(data) == env


def test_envelope_fingerprint_ignores_delivery_fields() -> None:
    env = Envelope.build(**fields())
    resent = Envelope.build(**fields(deadline=int(T0 + 60), hops=3))
    assert resent.fingerprint() == env.fingerprint()


@pytest.mark.parametrize(
    "change",
    [
        {"payload": {"q": "hello", "x": 1}},
        {"payload": {"q": "Hello"}},
        {"kind": "event"},
        {"correlation_id": "c1"},
        {"parent_id": "p1"},
        {"deadline": T0 + 61},
        {"deadline": T0 + 60.001},
        {"max_attempts": 4},
    ],
)
def test_envelope_fingerprint_covers_content_fields(change: dict[str, Any]) -> None:
    assert (
        Envelope.build(**fields(**change)).fingerprint() != Envelope.build(**fields()).fingerprint()
    )


def test_envelope_fingerprint_is_sha256_of_canonical_content() -> None:
    env = Envelope.build(**fields(payload={"z": [1, 2], "a": None}))
    expected = sha256_hex(canonical_numbers(canonical_json(env.content())))
    assert env.fingerprint() == expected
    assert len(expected) == 64
    assert env.payload_json() == '{"a":null,"z":[1,2]}'


def test_canonical_json_is_sorted_compact_utf8() -> None:
    assert canonical_json({"b": [1, 2.5], "a": "ü"}) == '{"a":"ü","b":[1,2.5]}'.encode()


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(math.nan, id="nan"),
        pytest.param({"a": math.inf}, id="inf"),
        pytest.param({1, 2}, id="set"),
        pytest.param(b"x", id="bytes"),
        pytest.param({"a": object()}, id="object"),
        pytest.param("\ud800", id="lone_surrogate"),
        pytest.param({1: "a", "b": 2}, id="mixed_keys"),
    ],
)
def test_canonical_json_raises_value_error_when_not_json(value: Any) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the documented contract is ValueError
        canonical_json(value)


def test_canonical_json_raises_value_error_when_nested_too_deep() -> None:
    value: Any = []
    for _ in range(100_000):
        value = [value]
    with pytest.raises(ValueError, match="not JSON-encodable"):
        canonical_json(value)


def test_check_payload_walks_hostile_depth_without_recursion() -> None:
    value: Any = {}
    for _ in range(200_000):
        value = {"a": value}
    with pytest.raises(EnvelopeError) as info:
        check_payload(value)
    assert info.value.reason == "too_deep"


def test_loads_strict_refuses_constants_and_duplicates() -> None:
    assert loads_strict('{"a": [1, 2.5, null]}') == {"a": [1, 2.5, None]}
    with pytest.raises(ValueError, match="NaN"):
        loads_strict("[NaN]")
    with pytest.raises(ValueError, match="duplicate key 'k'"):
        loads_strict('{"x": {"k": 1, "k": 2}}')


_json_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.sampled_from(["{", "[[[[", "{[", "\ud800"])
)
_json_values = st.recursive(
    _json_leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=60,
)


def _checked(check: Any, payload: Any) -> tuple[str, Any]:
    try:
        return ("ok", check(payload))
    except EnvelopeError as exc:
        return (exc.reason, exc.field)


@given(payload=st.dictionaries(st.text(max_size=4), _json_values, max_size=6))
@settings(max_examples=400, deadline=None)
def test_parsed_payload_check_agrees_with_the_full_walk(payload: dict[str, Any]) -> None:
    assert _checked(check_parsed_payload, payload) == _checked(check_payload, payload)


@pytest.mark.parametrize(
    "payload",
    [
        nested(PAYLOAD_MAX_DEPTH),
        nested(PAYLOAD_MAX_DEPTH + 1),
        {"a": "[" * 40},
        {"a": [0] * (PAYLOAD_MAX_NODES - 2)},
        {"a": [0] * (PAYLOAD_MAX_NODES - 1)},
        {"a": 1e308 * 10},
        sized(PAYLOAD_MAX_BYTES),
        sized(PAYLOAD_MAX_BYTES + 1),
    ],
)
def test_parsed_payload_check_agrees_at_the_edges(payload: dict[str, Any]) -> None:
    assert _checked(check_parsed_payload, payload) == _checked(check_payload, payload)


# -- handler results ---------------------------------------------------------------------------


def _as_result(payload: dict[str, Any]) -> tuple[str, Any]:
    """``check_result``'s answer in ``_checked``'s form (its field is ``result``)."""
    reason, answer = _checked(check_result, payload)
    return (reason, "payload" if answer == "result" else answer)


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        (nested(PAYLOAD_MAX_DEPTH), "ok"),
        (nested(PAYLOAD_MAX_DEPTH + 1), "too_deep"),
        ([[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]], "ok"),  # an array at the top is level 1
        ([[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]], "too_deep"),
        ({"a": "[" * 40}, "ok"),  # brackets in a string are no nesting (parsed back)
        ({"a": [0] * (PAYLOAD_MAX_NODES - 2)}, "ok"),
        ({"a": [0] * (PAYLOAD_MAX_NODES - 1)}, "too_many_nodes"),
        ([0] * (PAYLOAD_MAX_NODES - 1), "ok"),
        ([0] * PAYLOAD_MAX_NODES, "too_many_nodes"),
        (sized(PAYLOAD_MAX_BYTES), "ok"),
        (sized(PAYLOAD_MAX_BYTES + 1), "too_large"),
        (sized(PAYLOAD_MAX_BYTES, "é"), "ok"),
        (sized(PAYLOAD_MAX_BYTES + 1, "é"), "too_large"),
        ("x" * (PAYLOAD_MAX_BYTES - 2), "ok"),  # a string result: 2 quotes + the text
        ("x" * (PAYLOAD_MAX_BYTES - 1), "too_large"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 20 else "",
)
def test_check_result_bounds_any_json_value_like_a_payload(result: Any, reason: str) -> None:
    answer = _checked(check_result, result)
    if reason == "ok":
        assert answer == ("ok", canonical_json(result))
    else:
        assert answer == (reason, "result")


@pytest.mark.parametrize("result", [None, True, 0, -1.5, "", "text", [], [1, "a"], {}])
def test_check_result_takes_results_that_are_not_objects(result: Any) -> None:
    assert check_result(result) == canonical_json(result)


def test_check_result_takes_what_canonical_json_takes_and_refuses_the_rest() -> None:
    assert check_result({"pair": (1, 2)}) == b'{"pair":[1,2]}'
    assert check_result({3: "three", 1: "one"}) == b'{"1":"one","3":"three"}'
    for not_json in ({1, 2}, b"x", math.nan, {"a": [math.inf]}, {1: "a", "b": 2}):
        with pytest.raises(ValueError, match=r"not JSON|Out of range|NaN") as info:
            check_result(not_json)
        assert not isinstance(info.value, EnvelopeError)


@given(payload=st.dictionaries(st.text(max_size=4), _json_values, max_size=6))
@settings(max_examples=200, deadline=None)
def test_result_check_agrees_with_the_payload_check(payload: dict[str, Any]) -> None:
    """Within JSON, an object result has the bounds of a payload, reason for reason."""
    expected = _checked(check_payload, payload)
    if expected[0] in ("bad_utf8", "not_finite"):  # not JSON: canonical_json's ValueError
        with pytest.raises(ValueError, match=r"not JSON|Out of range|surrogate"):
            check_result(payload)
        return
    assert _as_result(payload) == expected


# -- numbers in the fingerprint ----------------------------------------------------------------


def _wire(payload_json: str, message_id: str = "m-1") -> Envelope:
    return Envelope.from_json(
        f'{{"deadline":1800000060,"message_id":"{message_id}","payload":{payload_json},'
        '"sender":"alice"}'
    )


@pytest.mark.parametrize(
    "spellings",
    [
        ["13", "13.0", "1.3e1", "130e-1", "13.000"],
        ["100", "1e2", "1E2", "100.0", "1e+2"],
        ["0", "0.0", "-0.0", "-0", "0e5"],
        ["9007199254740992", "9007199254740992.0", "9.007199254740992e15"],
        ["0.1", "1e-1", "0.10"],
        ["1e21", "1E21", "1000000000000000000000.0"],
    ],
    ids=["13", "100", "zero", "2**53", "0.1", "1e21"],
)
def test_envelope_fingerprint_treats_spellings_of_one_number_alike(spellings: list[str]) -> None:
    """A JavaScript resend writes ``13`` where the first send had ``13.0``: the same
    request. Python parses these as int or float; the fingerprint writes them alike."""
    prints = {_wire(f'{{"n":{s},"v":[{s}],"x":"k"}}').fingerprint() for s in spellings}
    assert len(prints) == 1


def test_envelope_fingerprint_keeps_distinct_numbers_and_strings_distinct() -> None:
    assert _wire('{"n":13}').fingerprint() != _wire('{"n":13.5}').fingerprint()
    assert _wire('{"n":13}').fingerprint() != _wire('{"n":"13"}').fingerprint()
    assert _wire('{"n":"13.0"}').fingerprint() != _wire('{"n":"13"}').fingerprint()  # strings
    # Beyond 2**53 an int keeps its exact digits; a float is the nearest double, written
    # the ECMAScript way: 2**53 + 1 as an int is not the float 9007199254740993.0.
    assert (
        _wire('{"n":9007199254740993}').fingerprint()
        != _wire('{"n":9007199254740993.0}').fingerprint()
    )
    assert (
        _wire('{"n":9007199254740993.0}').fingerprint()
        == _wire('{"n":9007199254740992}').fingerprint()
    )


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (13.0, "13"),
        (-0.0, "0"),
        (0.1, "0.1"),
        (4.35, "4.35"),
        (1e21, "1e+21"),
        (1e20, "100000000000000000000"),
        (1.2345678901234568e20, "123456789012345680000"),
        (2.0**60, "1152921504606847000"),
        (1e16, "10000000000000000"),
        (1e-6, "0.000001"),
        (1e-7, "1e-7"),
        (2.5e-5, "0.000025"),
        (-1.5e-7, "-1.5e-7"),
        (333333333.3333333, "333333333.3333333"),
        (1.7976931348623157e308, "1.7976931348623157e+308"),
        (5e-324, "5e-324"),
        (-5e-324, "-5e-324"),
        (1e23, "1e+23"),
        (1.5e300, "1.5e+300"),
    ],
)
def test_ecmascript_number_writes_doubles_as_javascript_does(value: float, text: str) -> None:
    """Number-to-String of ECMAScript (checked against node for these and 35,000 random
    doubles when written); RFC 8785's number form."""
    assert ecmascript_number(value) == text


def test_ecmascript_number_refuses_nan_and_infinity() -> None:
    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="not a JSON number"):
            ecmascript_number(value)


def test_envelope_fingerprint_of_floats_is_hash_of_ecmascript_form() -> None:
    env = _wire('{"a":[1.5,13.0,1e-07,true,false,null],"b":"1.0e5 \\"2.0\\"","c":-0.0}')
    content = (
        '{"correlation_id":null,"deadline":1800000060,"kind":"task","max_attempts":3,'
        '"parent_id":null,'
        '"payload":{"a":[1.5,13,1e-7,true,false,null],"b":"1.0e5 \\"2.0\\"","c":0}}'
    )
    assert env.fingerprint() == sha256_hex(content.encode())
    # the stored payload and the signed bytes are left as they were sent
    sent = '{"a":[1.5,13.0,1e-07,true,false,null],"b":"1.0e5 \\"2.0\\"","c":-0.0}'
    assert env.payload_json() == sent


def test_canonical_numbers_leaves_payloads_without_floats_as_they_are() -> None:
    plain = canonical_json({"name": "v1", "n": [1, -2, 10**30], "ok": True, "e": "E"})
    assert canonical_numbers(plain) is plain  # one scan, no rewrite
    digits_in_strings = canonical_json({"name": "v1.5e3", "n": [1, 2], "s": "3.0"})
    assert canonical_numbers(digits_in_strings) == digits_in_strings
    env = Envelope.build(**fields(payload={"q": "hello", "n": 3}))
    assert env.fingerprint() == sha256_hex(canonical_numbers(canonical_json(env.content())))


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


def _same_values(a: Any, b: Any) -> bool:
    """Equal, numbers compared as doubles where either is a float (an integral double of
    2**53 or more is written as digits, which Python reads back as an int)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_values(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same_values, a, b))
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and float in (type(a), type(b)):
        return not isinstance(a, bool) and not isinstance(b, bool) and float(a) == float(b)
    return type(a) is type(b) and a == b


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=4), json_values, max_size=4))
def test_canonical_numbers_keeps_every_value(payload: dict[str, Any]) -> None:
    """The rewritten bytes parse back to the same values, every float in ECMAScript form,
    and integral floats within 2**53 fingerprint like the int of the same value."""
    rewritten = canonical_numbers(canonical_json(payload))
    assert _same_values(json.loads(rewritten), payload)
    assert canonical_numbers(rewritten) == rewritten

    def as_ints(value: Any) -> Any:
        if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
            return int(value)
        if isinstance(value, list):
            return [as_ints(v) for v in value]
        if isinstance(value, dict):
            return {k: as_ints(v) for k, v in value.items()}
        return value

    ints = canonical_json(as_ints(payload))
    assert content_fingerprint(
        "task", rewritten, None, None, deadline=T0, max_attempts=3
    ) == content_fingerprint("task", ints, None, None, deadline=T0, max_attempts=3)


def test_envelope_refuses_integers_over_4300_digits() -> None:
    big = 10**INT_MAX_DIGITS  # 4301 digits
    with pytest.raises(EnvelopeError) as built:
        Envelope.build(**fields(payload={"n": big}))
    assert (built.value.field, built.value.reason) == ("payload", "too_large")
    assert Envelope.build(**fields(payload={"n": big - 1})).payload["n"] == big - 1
    with pytest.raises(EnvelopeError) as wire:
        _wire('{"n":1' + "0" * INT_MAX_DIGITS + "}")
    assert wire.value.reason == "unparseable"
