"""The per-entry limits and escapes of the readers, without a server."""

from __future__ import annotations

import pytest

from broker_adapter.errors import ConfigError
from broker_adapter.protocol.deadletter import describe, encodable
from broker_adapter.protocol.reply import REPLY_MAX_DEPTH, BadReply, load_body
from broker_adapter.redis.entry import StreamEntry
from broker_adapter.redis.internals import stream_entries
from broker_adapter.redis.reader_config import MAX_ENTRY_FIELDS, ReaderConfig


def test_encodable_escapes_only_what_utf8_cannot_encode() -> None:
    assert encodable("résumé ✓") == "résumé ✓"
    assert encodable("a\ud800b") == "a\\ud800b"
    assert encodable("x" * 5000) == "x" * 1000
    encodable("\udcff" * 2000).encode("utf-8")  # does not raise


def test_describe_survives_a_broken_str() -> None:
    class Odd(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert describe(Odd()) == "Odd"
    assert describe(ValueError("bad \ud800 é")) == "ValueError: bad \\ud800 \\xe9"


def test_raw_pairs_keep_repeated_names_that_the_dict_folds() -> None:
    (dup, ok, gone) = stream_entries(
        [[b"1-0", [b"env", b"a", b"env", b"b"]], [b"2-0", [b"v", b"1"]], [b"3-0", None]]
    )
    assert dup.fields == {b"env": b"b"}
    assert list(dup.flat()) == [b"env", b"a", b"env", b"b"]
    assert ok.fields == {b"v": b"1"}
    assert gone == StreamEntry("3-0", None, 1, None)
    assert list(StreamEntry("4-0", {b"a": b"1"}).flat()) == [b"a", b"1"]


def test_reader_config_bounds_the_fields_a_dead_letter_copies() -> None:
    assert ReaderConfig().max_entry_fields == 64
    with pytest.raises(ConfigError):
        ReaderConfig(max_entry_fields=MAX_ENTRY_FIELDS + 1)  # Lua unpack stays bounded
    with pytest.raises(ConfigError):
        ReaderConfig(max_entry_bytes=0)


@pytest.mark.parametrize(
    "body",
    [
        b'{"a": NaN}',
        b'{"a": Infinity}',
        b'{"a": 1, "a": 2}',
        b"\xff",
        b"[1]",
        b"[" * 10_000 + b"]" * 10_000,
        b'{"a":' + b"[" * REPLY_MAX_DEPTH + b"]" * REPLY_MAX_DEPTH + b"}",
    ],
)
def test_reply_body_parse_is_strict_and_bounded(body: bytes) -> None:
    with pytest.raises(BadReply) as caught:
        load_body(body)
    assert caught.value.reason == "bad_reply"


def test_reply_body_within_the_limits_parses() -> None:
    depth = REPLY_MAX_DEPTH - 1
    body = b'{"a":' + b"[" * depth + b"]" * depth + b', "b": [{}, {}, {}]}'
    assert set(load_body(body)) == {"a", "b"}
    many = b'{"list": [' + b",".join([b"{}"] * 500) + b"]}"
    assert len(load_body(many)["list"]) == 500
