"""What a dead letter may cost Redis, on a real redis-server: the copy of an entry nobody
authenticated is a prefix of ``UNTRUSTED_COPY_BYTES`` (an admitted one is copied up to the
reader's ``max_entry_bytes``), and a dead-letter stream keeps at most its cap of entries,
with an alarm when the cap bites. Both sides of each bound."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from broker_adapter.protocol.deadletter import TRUNCATED, UNTRUSTED_COPY_BYTES
from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import connect
from broker_adapter.redis.dead_lettering import DeadLetterWriter
from broker_adapter.redis.entry import StreamEntry
from broker_adapter.redis.reader_config import ReaderConfig, ReaderStats
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

GROUP = "g"


def _writer(client: Any, stream: str, stats: ReaderStats, cap: int) -> DeadLetterWriter:
    config = ReaderConfig(max_entry_bytes=1024 * 1024)
    log = logging.getLogger("test.dead_letter_bounds")
    return DeadLetterWriter(
        client, stream, GROUP, "c", Keys().dead_for(stream), config, stats, log, cap=cap
    )


def _entries(client: Any, stream: str, sizes: list[int]) -> list[StreamEntry]:
    """Entries of one field ``p`` whose name and value together are ``size`` bytes, read
    by the group (pending, as a reader holds them)."""
    for size in sizes:
        client.xadd(stream, {"p": b"x" * (size - 1)})
    client.xgroup_create(stream, GROUP, id="0")
    ((_, got),) = client.xreadgroup(GROUP, "c", {stream: ">"})
    return [StreamEntry(eid.decode(), dict(f), 1) for eid, f in got]


def test_untrusted_copies_are_a_prefix_and_admitted_ones_are_whole(
    redis_server: RedisServer, prefix: str
) -> None:
    client: Any = connect(redis_server.url)
    stream = f"{prefix}:{{in}}:tasks"
    dead_stream = Keys().dead_for(stream)
    stats = ReaderStats()
    writer = _writer(client, stream, stats, cap=0)
    at, over = _entries(client, stream, [UNTRUSTED_COPY_BYTES, UNTRUSTED_COPY_BYTES + 1])
    writer.write(at, "bad_signature", "x")
    writer.write(over, "bad_signature", "x")
    writer.write_many([(over, "rate_limited", "x", {})])  # the flood path: a prefix too
    writer.write(over, "expired", "x", trusted=True)  # authenticated and admitted
    letters = [f for _, f in client.xrange(dead_stream)]
    copied = [
        sum(len(k) - 5 + len(v) for k, v in f.items() if k.startswith(b"orig.")) for f in letters
    ]
    assert copied == [
        UNTRUSTED_COPY_BYTES,
        UNTRUSTED_COPY_BYTES,
        UNTRUSTED_COPY_BYTES,
        UNTRUSTED_COPY_BYTES + 1,
    ]
    assert [TRUNCATED.encode() in f for f in letters] == [False, True, True, False]


def test_a_dead_letter_stream_keeps_its_cap_and_says_when_it_bites(
    redis_server: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    client: Any = connect(redis_server.url)
    stream = f"{prefix}:{{in}}:tasks"
    dead_stream = Keys().dead_for(stream)
    stats = ReaderStats()
    writer = _writer(client, stream, stats, cap=3)
    entries = _entries(client, stream, [10] * 6)
    caplog.set_level(logging.ERROR)
    for e in entries[:3]:
        writer.write(e, "bad_signature", "x")
    assert client.xlen(dead_stream) == 3  # at the cap: nothing trimmed, no alarm
    assert stats.dead_letters_capped == 0
    assert not [r for r in caplog.records if "at its cap" in r.getMessage()]
    writer.write(entries[3], "bad_signature", "x")  # one over
    writer.write_many([(e, "rate_limited", "x", {}) for e in entries[4:]])
    assert client.xlen(dead_stream) == 3
    assert stats.dead_letters_capped == 3
    assert len([r for r in caplog.records if "at its cap of 3" in r.getMessage()]) == 3
    kept = [f[b"dl.entry_id"].decode() for _, f in client.xrange(dead_stream)]
    assert kept == [e.entry_id for e in entries[3:]]  # the newest stay
    assert client.xpending(stream, GROUP)["pending"] == 0  # every one acknowledged
