"""Streams whose ids ran ahead of the server clock, on a real redis-server: an XADD with the
largest id stops every later ``XADD *`` until ``broker-adapter streams repair`` (a real
subprocess) moves the live entries to a fresh stream while the ingest keeps its group; an
id in the future raises the alarm and no longer stops the inbound trim."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from broker_adapter.client.publisher import Publisher
from broker_adapter.clock import FakeClock
from broker_adapter.errors import BrokerAdapterError
from broker_adapter.protocol.keys import INGEST_GROUP, Keys
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect, text
from broker_adapter.redis.repair import repair_stream
from broker_adapter.redis.trimming import FUTURE_TOLERANCE_MS, trim_stream
from broker_adapter.stages.ingest.config import IngestConfig
from broker_adapter.stages.ingest.ingest import Ingestor
from broker_adapter.store import TaskStore
from tests.support.cli import cli_env
from tests.support.ingest_script import drain, envelope, real_deadline, task_counts, xadd_signed
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MAX_ID = "18446744073709551615-18446744073709551615"


def _ingestor(
    server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> tuple[Ingestor, Any]:
    client = connect(server.url)
    config = IngestConfig(prefix=prefix, consumer="ingest-t", block_ms=20, trim_keep_s=300)
    return Ingestor(config, client, tasks, keyring, clock=clock), client


def _repair_cli(server: RedisServer, prefix: str, stream: str, *more: str) -> Any:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "streams",
            "repair",
            "--redis",
            server.url,
            "--prefix",
            prefix,
            "--stream",
            stream,
            *more,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
    )


def test_the_largest_id_stops_adding_until_streams_repair_and_nothing_published_is_lost(
    redis_server: RedisServer, prefix: str, tasks: TaskStore, keyring: Keyring, clock: FakeClock
) -> None:
    clock.set(time.time())
    ingestor, client = _ingestor(redis_server, prefix, tasks, keyring, clock)
    keys = Keys(prefix)
    stream = keys.inbound()
    publisher = Publisher(client, keys, "alice", keyring)
    publisher.publish(envelope("before", deadline=real_deadline()))
    drain(ingestor, client)
    xadd_signed(client, keys, keyring, envelope("unread", deadline=real_deadline()))  # live
    client.xadd(stream, {"v": "1", "env": "{}"}, id=MAX_ID)  # a writer with +xadd chose the id
    with pytest.raises(redis.ResponseError, match="exhausted the last possible ID"):
        client.xadd(stream, {"v": "1"})  # no XADD * works on the stream any more
    publisher.publish(envelope("blocked", deadline=real_deadline()))  # waits in the list

    res = _repair_cli(redis_server, prefix, stream)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["moved"] == 2  # "unread" and the poisoned entry; "before" was acknowledged
    assert out["kept_as"].startswith(f"{stream}:poisoned:")
    assert out["groups"][INGEST_GROUP] != "$"
    assert "audit: streams repair by os user" in res.stderr

    publisher.publish(envelope("after", deadline=real_deadline()))
    drain(ingestor, client)  # the same ingestor, never stopped: its group was kept
    assert task_counts(tasks) == {("alice", m): 1 for m in ("before", "unread", "blocked", "after")}
    dead = client.xrange(keys.inbound_dead())
    assert [f[b"dl.reason"] for _, f in dead] == [b"missing_field"]  # the poisoned entry
    assert client.xlen(out["kept_as"]) == 3  # kept for the operator, whole


def test_repair_keeps_what_each_group_still_needs(redis_server: RedisServer, prefix: str) -> None:
    client: Any = connect(redis_server.url)
    stream = Keys(prefix).inbound()
    ids = [text(client.xadd(stream, {"n": str(i)})) for i in range(6)]
    client.xgroup_create(stream, "fast", id="0")
    client.xgroup_create(stream, "slow", id="0")
    client.xreadgroup("fast", "c", {stream: ">"}, count=6)
    client.xack(stream, "fast", *ids[:3])  # fast: 3..5 pending
    client.xreadgroup("slow", "c", {stream: ">"}, count=2)  # slow: 0, 1 pending, 2.. unread
    client.xack(stream, "slow", ids[0])
    result = repair_stream(client, stream, server_ms=1)
    assert result.moved == 5  # 1..5: the oldest entry slow has not acknowledged, on
    new = [text(eid) for eid, _ in client.xrange(stream)]
    assert [f[b"n"] for _, f in client.xrange(stream)] == [b"1", b"2", b"3", b"4", b"5"]
    assert result.groups == {"slow": "0", "fast": new[1]}  # fast starts after "2"
    got = client.xreadgroup("fast", "c", {stream: ">"})
    assert [f[b"n"] for _, f in got[0][1]] == [b"3", b"4", b"5"]
    # the bound: a stream with more live entries than asked for is left alone
    with pytest.raises(BrokerAdapterError, match="more than 4 live entries"):
        repair_stream(client, stream, server_ms=2, max_entries=4)
    assert repair_stream(client, stream, server_ms=3, max_entries=5).moved == 5


def test_streams_repair_refuses_bad_input(redis_server: RedisServer, prefix: str) -> None:
    stream = Keys(prefix).inbound()
    res = _repair_cli(redis_server, prefix, "other:{in}:tasks")
    assert res.returncode == 2
    assert "not a stream of prefix" in res.stderr
    res = _repair_cli(redis_server, prefix, stream, "--max-entries", "0")
    assert res.returncode == 2
    assert "--max-entries must be" in res.stderr
    res = _repair_cli(redis_server, prefix, stream)  # no such stream
    assert res.returncode == 1
    assert "no stream" in res.stderr


def test_an_id_in_the_future_raises_the_alarm_and_trimming_goes_on(
    redis_server: RedisServer,
    prefix: str,
    tasks: TaskStore,
    keyring: Keyring,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock.set(time.time())
    ingestor, client = _ingestor(redis_server, prefix, tasks, keyring, clock)
    keys = Keys(prefix)
    stream = keys.inbound()
    client.xadd(stream, {"v": "1", "env": "{}"}, id="9999999999999-0")
    publisher = Publisher(client, keys, "alice", keyring)
    for i in range(200):  # every * id now follows the future one
        publisher.publish(envelope(f"m{i}", deadline=real_deadline()))
    drain(ingestor, client)
    assert client.xlen(stream) == 201
    caplog.set_level(logging.ERROR)
    removed = ingestor.trim()
    assert removed == 200  # all but the last delivered entry, keep window or not
    assert client.xlen(stream) == 1
    assert ingestor.stats.future_ids == 1
    (alarm,) = [
        r.getMessage() for r in caplog.records if "ahead of the server clock" in r.getMessage()
    ]
    assert "streams repair" in alarm
    assert stream in alarm


def test_the_future_tolerance_edge(redis_server: RedisServer, prefix: str) -> None:
    """A last-delivered id within FUTURE_TOLERANCE_MS of the server clock is not an alarm
    and keeps the keep floor; one well beyond it is."""
    client: Any = connect(redis_server.url)
    seconds, micros = client.time()
    now = seconds * 1000 + micros // 1000
    for n, ahead in enumerate((FUTURE_TOLERANCE_MS - 5_000, FUTURE_TOLERANCE_MS + 5_000)):
        stream = f"{prefix}:{{s{n}}}:tasks"
        client.xadd(stream, {"a": "1"}, id=f"{now - 1000}-0")
        client.xadd(stream, {"a": "2"}, id=f"{now + ahead}-0")
        client.xadd(stream, {"a": "3"})
        client.xgroup_create(stream, "g", id="0")
        got = client.xreadgroup("g", "c", {stream: ">"})
        client.xack(stream, "g", *[eid for eid, _ in got[0][1]])
        result = trim_stream(client, stream, keep_from_ms=now - 10_000)
        if ahead < FUTURE_TOLERANCE_MS:
            assert (result.future_id, result.trimmed) == ("", 0)  # the keep floor holds
        else:
            assert result.future_id == text(got[0][1][-1][0])
            assert result.trimmed == 2  # up to the last delivered one


def test_repair_of_a_stream_whose_group_read_the_largest_id(
    redis_server: RedisServer, prefix: str
) -> None:
    client: Any = connect(redis_server.url)
    stream = Keys(prefix).inbound()
    client.xadd(stream, {"n": "0"})
    client.xadd(stream, {"n": "max"}, id=MAX_ID)
    client.xgroup_create(stream, "g", id="0")
    got = client.xreadgroup("g", "c", {stream: ">"})
    client.xack(stream, "g", *[eid for eid, _ in got[0][1]])
    result = repair_stream(client, stream, server_ms=1)
    assert (result.moved, result.groups) == (0, {"g": "$"})
    new_id = text(client.xadd(stream, {"n": "1"}))  # * works again, and the group reads it
    assert [text(e) for e, _ in client.xreadgroup("g", "c", {stream: ">"})[0][1]] == [new_id]
