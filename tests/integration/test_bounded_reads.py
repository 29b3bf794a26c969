"""Bounded reads: entries too large to fetch are measured and dead-lettered inside Redis
(``redis.screening``), so that a reader under a memory limit keeps going.

The processes run for real (``broker-adapter run`` and ``receive`` subprocesses) under an
address-space limit of 1 GB (``RLIMIT_AS``), against a private redis-server, with several
64 MB entries in their streams added while they were down."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.protocol.keys import INGEST_GROUP
from broker_adapter.redis.client import connect
from broker_adapter.redis.reader import GroupReader
from broker_adapter.redis.reader_config import ReaderConfig
from tests.support.cli import cli_env, count_rows, publish_range, run_cli, wait_for
from tests.support.redis_server import RedisServer, require_binary

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
#: The address-space limit of the processes under test (a container's memory limit).
LIMIT_BYTES = 1024 * 1024 * 1024
BIG = 64 * 1024 * 1024
N_BIG = 5


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server: hundreds of megabytes of entries stay out of the shared one."""
    require_binary()
    srv = RedisServer(tmp_path / "redis")
    srv.start()
    yield srv
    srv.stop()


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI under the address-space limit."""
    return run_cli(*args, timeout=120, preexec_fn=_limited)


def _keyring(tmp_path: Path) -> Path:
    path = tmp_path / "keyring.json"
    path.write_text(json.dumps({"alice": {"k1": "alice-secret: a test key of 32 bytes or more"}}))
    path.chmod(0o600)
    return path


def _add_big(client: Any, stream: str, n: int) -> list[str]:
    blob = b"x" * BIG  # one buffer, sent n times
    return [client.xadd(stream, {"v": "1", "env": blob}).decode() for _ in range(n)]


def _dead(client: Any, stream: str) -> dict[str, dict[bytes, bytes]]:
    return {f[b"dl.entry_id"].decode(): f for _, f in client.xrange(stream) if b"dl.entry_id" in f}


def test_run_and_receive_under_1gb_dead_letter_64mb_entries_and_do_the_work_behind_them(
    server: RedisServer, tmp_path: Path, prefix: str
) -> None:
    keyring = _keyring(tmp_path)
    client: Any = server.client()
    inbound = f"{prefix}:{{in}}:tasks"
    # While the adapter is down: two requests, five 64 MB entries, two more requests.
    publish_range(server.url, keyring, prefix, range(2), cli=_cli)
    big_in = _add_big(client, inbound, N_BIG)
    publish_range(server.url, keyring, prefix, range(2, 4), cli=_cli)
    db = tmp_path / "adapter.db"
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "run",
            "--redis",
            server.url,
            "--db",
            str(db),
            "--handler",
            "broker_adapter.examples:echo",
            "--workers",
            "2",
            "--keyring",
            str(keyring),
            "--prefix",
            prefix,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(),
        preexec_fn=_limited,
    )
    try:
        wait_for(
            lambda: (
                count_rows(db, "SELECT count(*) FROM outbox WHERE state = 'sent'") == 4
                or run.poll() is not None
            ),
            "the four replies",
            timeout_s=120,
        )
        assert run.poll() is None, "run exited"
        # Replies of the receiver's principal, then three 64 MB entries on its stream.
        replies = f"{prefix}:{{out.alice}}:replies"
        big_out = _add_big(client, replies, 3)
    finally:
        run.terminate()
        out, _ = run.communicate(timeout=60)
    assert run.returncode == 0, out[-3000:]
    assert "MemoryError" not in out
    dead = _dead(client, f"{prefix}:{{in}}:dead")
    assert sorted(dead) == sorted(big_in)
    for letter in dead.values():
        assert letter[b"dl.reason"] == b"oversize"
        assert f"entry is {BIG + 5} bytes".encode() in letter[b"dl.detail"]
        copied = sum(len(v) for k, v in letter.items() if k.startswith(b"orig."))
        assert 0 < copied <= 256 * 1024  # a bounded prefix (the ingest's max_entry_bytes)
        assert b"dl.truncated" in letter
    # Every one of them was acknowledged: nothing is pending for the ingest.
    assert client.xpending(inbound, INGEST_GROUP)["pending"] == 0

    rdb = tmp_path / "receiver.db"
    res = _cli(
        "receive",
        "--redis",
        server.url,
        "--db",
        str(rdb),
        "--principal",
        "alice",
        "--prefix",
        prefix,
        "--until-idle",
        "5",
        "--keyring",
        str(keyring),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert count_rows(rdb, "SELECT count(*) FROM receipts") == 4
    reply_dead = _dead(client, f"{prefix}:{{out.alice}}:dead")
    assert sorted(reply_dead) == sorted(big_out)
    assert {d[b"dl.reason"] for d in reply_dead.values()} == {b"oversize"}
    client.close()


def _reader(url: str, prefix: str, **cfg: int) -> GroupReader:
    client = connect(url)
    stream = f"{prefix}:{{in}}:tasks"
    reader = GroupReader(client, stream, "g", "c1", f"{prefix}:{{in}}:dead", ReaderConfig(**cfg))
    reader.ensure_group()
    return reader


def test_screened_read_passes_an_entry_of_exactly_max_entry_bytes_and_refuses_one_more(
    redis_server: RedisServer, prefix: str
) -> None:
    reader = _reader(redis_server.url, prefix, max_entry_bytes=1000)
    client: Any = redis_server.client()
    fits = client.xadd(reader.stream, {"n": b"x" * 999}).decode()  # 1 + 999 bytes
    over = client.xadd(reader.stream, {"n": b"x" * 1000}).decode()
    assert reader.read(block=False) == []  # the empty replay of its own pending list
    got = reader.read(block=False)
    assert [e.entry_id for e in got] == [fits]
    dead = _dead(client, reader.dead_stream)
    assert list(dead) == [over]
    assert dead[over][b"dl.reason"] == b"oversize"
    assert dead[over][b"dl.consumer"] == b"c1"
    assert dead[over][b"dl.deliveries"] == b"1"
    assert dead[over][b"orig.n"] == b"x" * 999  # the copy: name and value within 1000 bytes
    assert reader.stats.by_reason == {"oversize": 1}
    assert client.xpending(reader.stream, "g")["pending"] == 1  # only the one handed out


def test_screened_read_returns_at_most_max_batch_bytes_and_the_rest_next(
    redis_server: RedisServer, prefix: str
) -> None:
    # Entries of 100 bytes (1 + 99); a budget of 300 bytes takes three, 299 takes two.
    for budget, per_read in ((300, 3), (299, 2)):
        reader = _reader(redis_server.url, f"{prefix}{budget}", max_batch_bytes=budget)
        client: Any = redis_server.client()
        ids = [client.xadd(reader.stream, {"n": b"y" * 99}).decode() for _ in range(7)]
        assert reader.read(block=False) == []
        seen: list[str] = []
        sizes: list[int] = []
        for _ in range(20):
            batch = reader.read(block=False)
            if not batch and len(seen) == len(ids):
                break
            sizes.append(len(batch))
            seen += [e.entry_id for e in batch]
            reader.ack([e.entry_id for e in batch])
        assert sorted(set(seen)) == ids
        assert max(sizes) == per_read
        assert reader.stats.by_reason == {}


def test_screened_read_returns_a_single_entry_larger_than_the_batch_budget(
    redis_server: RedisServer, prefix: str
) -> None:
    reader = _reader(redis_server.url, prefix, max_batch_bytes=10, max_entry_bytes=1000)
    client: Any = redis_server.client()
    big = client.xadd(reader.stream, {"n": b"z" * 500}).decode()
    assert reader.read(block=False) == []
    assert [e.entry_id for e in reader.read(block=False)] == [big]


def test_take_over_screens_claimed_entries_inside_redis(
    redis_server: RedisServer, prefix: str
) -> None:
    reader = _reader(redis_server.url, prefix, max_entry_bytes=1000, claim_min_idle_ms=0)
    client: Any = redis_server.client()
    small = client.xadd(reader.stream, {"n": b"s"}).decode()
    over = client.xadd(reader.stream, {"n": b"o" * 2000}).decode()
    client.xreadgroup("g", "dead-one", {reader.stream: ">"}, count=10)  # a consumer that died
    got = reader.take_over()
    assert [e.entry_id for e in got] == [small]
    assert list(_dead(client, reader.dead_stream)) == [over]
    assert _dead(client, reader.dead_stream)[over][b"dl.deliveries"] == b"2"


def test_reader_without_fcall_reads_one_entry_at_a_time(
    redis_server: RedisServer, prefix: str
) -> None:
    """A Redis user that may not call the function: plain reads of ONE entry each (the
    most it can hold unmeasured), an alarm, and nothing lost."""
    admin: Any = redis_server.client()
    user, pw = f"nofcall-{prefix}", "nofcall-password"
    admin.execute_command(
        "ACL",
        "SETUSER",
        user,
        "on",
        f">{pw}",
        "resetchannels",
        "-@all",
        "+ping",
        "+xreadgroup",
        "+xack",
        "+xpending",
        "+xautoclaim",
        "+xgroup|create",
        "+evalsha",
        "+script|load",
        "+xadd",
        f"~{prefix}:*",
    )
    try:
        url = f"redis://{user}:{pw}@127.0.0.1:{redis_server.port}/0"
        reader = _reader(url, prefix)
        ids = [admin.xadd(reader.stream, {"n": str(i)}).decode() for i in range(3)]
        assert reader.read(block=False) == []
        batches = [reader.read(block=False) for _ in range(3)]
        assert [[e.entry_id for e in b] for b in batches] == [[i] for i in ids]
        assert reader.reads.screening is False
    finally:
        admin.execute_command("ACL", "DELUSER", user)


def _blocked(client: Any) -> int:
    """Clients blocked in a read right now (CLIENT LIST flag ``b``)."""
    return sum(1 for c in client.client_list() if "b" in c["flags"])


def _receipts(rdb: Path) -> int:
    return count_rows(rdb, "SELECT count(*) FROM receipts")


def test_flushall_and_del_under_blocking_reads_leave_ingest_and_receiver_running(
    server: RedisServer, tmp_path: Path, prefix: str
) -> None:
    """The ingest and a receiver blocked in XREADGROUP get ``UNBLOCKED the stream key no
    longer exists`` from a FLUSHALL, then from a DEL of their streams: both recreate their
    group from 0 and go on; the requests published afterwards are run and received (the
    wipe's re-sent replies end as duplicates)."""
    keyring = _keyring(tmp_path)
    client: Any = server.client()
    db, rdb = tmp_path / "adapter.db", tmp_path / "receiver.db"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "broker_adapter", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=cli_env(),
        )
        for args in (
            [
                "run",
                "--redis",
                server.url,
                "--db",
                str(db),
                "--handler",
                "broker_adapter.examples:echo",
                "--workers",
                "1",
                "--keyring",
                str(keyring),
                "--prefix",
                prefix,
            ],
            [
                "receive",
                "--redis",
                server.url,
                "--db",
                str(rdb),
                "--principal",
                "alice",
                "--prefix",
                prefix,
                "--keyring",
                str(keyring),
            ],
        )
    ]
    try:
        publish_range(server.url, keyring, prefix, range(1), cli=_cli)
        wait_for(lambda: _receipts(rdb) == 1, "the first reply received", timeout_s=60)
        streams = (f"{prefix}:{{in}}:tasks", f"{prefix}:{{out.alice}}:replies")
        for i, wipe in enumerate(("FLUSHALL", "DEL")):
            wait_for(lambda: _blocked(client) >= 2, "the ingest and the receiver blocking")
            client.execute_command(*(("FLUSHALL",) if wipe == "FLUSHALL" else ("DEL", *streams)))
            publish_range(server.url, keyring, prefix, range(i + 1, i + 2), cli=_cli)
            want = i + 2
            wait_for(lambda: _receipts(rdb) == want, f"reply {want - 1} received", timeout_s=60)  # noqa: B023
            assert [p.poll() for p in procs] == [None, None]
    finally:
        for p in procs:
            p.terminate()
        outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for out in outs:
        assert "recreating from 0" in out
