"""Agents publish to submit lists and never choose a stream id (docs/PROTOCOL.md sections 3
and 9): the documented agent user has ``+rpush`` on its submit list and no ``+xadd``, the
adapter moves the items into the stream with ``XADD *`` (``redis.screening``), refuses the
malformed and oversize ones into the dead-letter stream with a bounded copy, and loses none
across a crash. Real redis-servers, real ``broker-adapter run`` processes."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from broker_adapter.client.publisher import Publisher, submit_item
from broker_adapter.client.request import Client
from broker_adapter.clock import FakeClock
from broker_adapter.protocol.deadletter import UNTRUSTED_COPY_BYTES
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect
from broker_adapter.redis.repair import repair_stream
from broker_adapter.redis.screening_lua import SOURCE
from broker_adapter.stages.ingest.config import IngestConfig
from broker_adapter.stages.ingest.ingest import Ingestor
from broker_adapter.store import TaskStore, open_database
from tests.support.cli import cli_env, count_rows, wait_for
from tests.support.ingest_script import (
    KEYRING,
    envelope,
    real_deadline,
    task_counts,
    write_keyring,
)
from tests.support.redis_server import RedisServer, require_binary

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
LIMIT_BYTES = 1024 * 1024 * 1024
BIG = 64 * 1024 * 1024
MAX_ID = "18446744073709551615-18446744073709551615"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    require_binary()
    srv = RedisServer(tmp_path / "redis")
    srv.start()
    yield srv
    srv.stop()


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))


def _run(url: str, db: Path, keyring: Path, prefix: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "run",
            "--redis",
            url,
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
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(),
        preexec_fn=_limited,
    )


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-3000:]
    return out


def _sent(db: Path) -> int:
    return count_rows(db, "SELECT count(*) FROM outbox WHERE state = 'sent'")


def _agent_user(server: RedisServer, admin: Any, keys: Keys, principal: str) -> str:
    """The signed-mode agent user of PROTOCOL.md section 9: RPUSH on the shared submit
    list, read-only on its replies and result records; its URL."""
    password = f"{principal}-password"
    admin.execute_command(
        "ACL",
        "SETUSER",
        principal,
        "reset",
        "on",
        f">{password}",
        "resetchannels",
        "-@all",
        "+rpush",
        f"~{keys.submit()}",
        f"(+xread +xrevrange +hgetall ~{keys.replies(principal)} "
        f"~{keys.replies(principal).rsplit(':', 1)[0]}:res:*)",
    )
    return f"redis://{principal}:{password}@127.0.0.1:{server.port}/0"


def _last_id_ms(client: Any, stream: str) -> int:
    return int(client.xinfo_stream(stream)["last-generated-id"].decode().split("-")[0])


def test_the_agent_user_cannot_choose_an_id_and_intake_goes_on_for_everyone(
    server: RedisServer, tmp_path: Path, prefix: str
) -> None:
    """The documented agent user gets NOPERM for any XADD (the largest id, an id in the
    future, ``*``); what it may send, items in the submit list that look like ids, is added
    with ``*`` and refused as an entry: bob's request behind them is done, and the stream's
    ids stay at the server's clock."""
    keys, admin = Keys(prefix), cast(Any, server.client())
    keyring = tmp_path / "keyring.json"
    write_keyring(keyring)
    alice = connect(_agent_user(server, admin, keys, "alice"))
    bob_url = _agent_user(server, admin, keys, "bob")
    fields = Keyring(KEYRING).sign(envelope("m1", deadline=real_deadline()))
    for entry_id in (MAX_ID, "9999999999999-0", "*"):
        with pytest.raises(redis.exceptions.NoPermissionError):
            alice.xadd(keys.inbound(), fields, id=entry_id)  # type: ignore[arg-type]
    # Through the one granted command: items that carry ids, a command, anything.
    alice.rpush(keys.submit(), json.dumps([MAX_ID, "x"]), json.dumps(["id", MAX_ID, "v", "1"]))
    alice.rpush(keys.submit(), json.dumps({"XADD": [keys.inbound(), MAX_ID]}))
    db = tmp_path / "adapter.db"
    run = _run(server.url, db, keyring, prefix)
    try:
        with Client(bob_url, "bob", Keyring(KEYRING), prefix=prefix) as bob:
            reply = bob.request(None, {"n": 1}, message_id="b1", timeout_s=60)
        assert (reply.status, reply.message_id) == ("done", "b1")
        assert run.poll() is None
    finally:
        _stop(run)
    (server_s, _) = admin.time()
    assert _last_id_ms(admin, keys.inbound()) <= (server_s + 1) * 1000  # no id ahead
    reasons = sorted(f[b"dl.reason"] for _, f in admin.xrange(keys.inbound_dead()))
    assert reasons == [b"bad_item", b"missing_field", b"missing_field"]
    assert admin.llen(keys.submit()) == 0
    alice.close()


def test_a_64mb_item_and_a_malformed_one_are_dead_lettered_and_the_valid_one_done(
    server: RedisServer, tmp_path: Path, prefix: str
) -> None:
    """Under a 1 GB address-space limit: 64 MB items (pushed while the adapter is down and
    while it waits on the list), a malformed item and a valid request. The large and the
    malformed ones go to the dead-letter stream with a bounded prefix, never into the
    tasks stream; the valid one is done."""
    keys, client = Keys(prefix), cast(Any, server.client())
    keyring = tmp_path / "keyring.json"
    write_keyring(keyring)
    big = submit_item({"v": b"1", "env": b"x" * BIG})
    client.rpush(keys.submit(), big)
    db = tmp_path / "adapter.db"
    run = _run(server.url, db, keyring, prefix)
    try:
        wait_for(lambda: client.llen(keys.submit()) == 0, "the first item moved")
        client.rpush(keys.submit(), big, big)
        client.rpush(keys.submit(), b"\xff not json", b'["v", "1", "env"]')
        pub = Publisher(client, keys, "alice", Keyring(KEYRING))
        pub.publish(envelope("ok", deadline=real_deadline()))
        wait_for(lambda: _sent(db) == 1 or run.poll() is not None, "the valid request's reply")
        assert run.poll() is None, "run exited"
    finally:
        out = _stop(run)
    assert "MemoryError" not in out
    assert client.xlen(keys.inbound()) == 1  # only the valid one reached the stream
    dead = [f for _, f in client.xrange(keys.inbound_dead())]
    assert sorted(f[b"dl.reason"] for f in dead) == [b"bad_item", b"bad_item"] + [b"oversize"] * 3
    for letter in dead:
        assert letter[b"dl.source"] == keys.inbound().encode()
        assert letter[b"dl.submit"] == keys.submit().encode()
        assert b"dl.truncated" in letter
        copied = sum(len(k) + len(v) for k, v in letter.items() if k.startswith(b"orig."))
        assert 0 < copied <= UNTRUSTED_COPY_BYTES + 64
    oversize = [f for f in dead if f[b"dl.reason"] == b"oversize"]
    assert all(f"item is {len(big)} bytes".encode() in f[b"dl.detail"] for f in oversize)
    assert all(f[b"orig.item"] == big[: len(f[b"orig.item"])] for f in oversize)
    client.close()


def test_items_published_while_the_adapter_is_down_or_killed_are_all_done_once(
    server: RedisServer, tmp_path: Path, prefix: str
) -> None:
    keys, client = Keys(prefix), cast(Any, server.client())
    keyring = tmp_path / "keyring.json"
    write_keyring(keyring)
    pub = Publisher(client, keys, "alice", Keyring(KEYRING))
    for i in range(10):
        assert pub.publish(envelope(f"m{i}", deadline=real_deadline())) == f"m{i}"
    assert client.llen(keys.submit()) == 10  # waiting in the list, not in the stream
    assert client.exists(keys.inbound()) == 0
    db = tmp_path / "adapter.db"
    run = _run(server.url, db, keyring, prefix)
    try:
        wait_for(lambda: _sent(db) == 10, "the first ten replies")
    finally:
        run.send_signal(signal.SIGKILL)
        run.communicate(timeout=60)
    for i in range(10, 30):
        pub.publish(envelope(f"m{i}", deadline=real_deadline()))
    run = _run(server.url, db, keyring, prefix)
    try:
        for i in range(30, 40):  # and while it starts and runs
            pub.publish(envelope(f"m{i}", deadline=real_deadline()))
        wait_for(lambda: _sent(db) == 40, "all forty replies")
    finally:
        _stop(run)
    assert count_rows(db, "SELECT count(*) FROM tasks") == 40
    assert client.llen(keys.submit()) == 0
    assert client.xlen(keys.inbound_dead()) == 0
    client.close()


def test_an_idle_ingest_wakes_up_on_a_push_to_its_submit_list(
    server: RedisServer, tmp_path: Path, prefix: str
) -> None:
    """The ingest waits on the submit list: a publish ends a 30-second wait at once."""
    keys, client = Keys(prefix), connect(server.url)
    tasks = TaskStore(open_database(tmp_path / "inbox.db"), FakeClock())
    config = IngestConfig(prefix=prefix, consumer="ingest-wake-0", block_ms=30_000)
    ingestor = Ingestor(config, connect(server.url, socket_timeout_s=60), tasks, Keyring(KEYRING))
    assert ingestor.step() == 0  # the first read replays its own pending list: no wait
    handled: list[int] = []
    stepping = threading.Thread(target=lambda: handled.append(ingestor.step()))
    stepping.start()
    wait_for(
        lambda: any(c.get("cmd") == "blmove" for c in server.client().client_list()),
        "the ingest waiting on the list",
    )
    started = time.monotonic()
    Publisher(client, keys, "alice", Keyring(KEYRING)).publish(envelope("wake"))
    stepping.join(timeout=20)
    assert not stepping.is_alive()
    assert handled == [1]
    assert time.monotonic() - started < 10  # not the 30-second wait


def test_an_item_that_cannot_be_added_waits_in_its_list_and_the_ingest_goes_on(
    server: RedisServer, tmp_path: Path, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream at the largest id (a user with ``+xadd``): the item goes back to the head of
    its list (one alarm, no loss, the ingest keeps running), and is added after the repair."""
    keys, client = Keys(prefix), connect(server.url)
    tasks = TaskStore(open_database(tmp_path / "inbox.db"), FakeClock())
    config = IngestConfig(prefix=prefix, consumer="ingest-stuck-0", block_ms=20)
    ingestor = Ingestor(config, client, tasks, Keyring(KEYRING))
    client.xadd(keys.inbound(), {"v": "1"}, id=MAX_ID)
    pub = Publisher(client, keys, "alice", Keyring(KEYRING))
    pub.publish(envelope("waits", deadline=real_deadline()))
    for _ in range(4):
        ingestor.step()  # the poisoned entry is dead-lettered; the item cannot be added
    assert client.llen(keys.submit()) == 1  # back at the head, not lost
    alarms = [r for r in caplog.records if "cannot add entries" in r.getMessage()]
    assert len(alarms) == 1
    (server_s, _) = cast(Any, client).time()
    repair_stream(client, keys.inbound(), server_ms=server_s * 1000)
    for _ in range(3):
        ingestor.step()
    assert client.llen(keys.submit()) == 0
    assert task_counts(tasks) == {("alice", "waits"): 1}


def test_a_screening_library_without_admission_loaded_by_an_older_release_is_replaced(
    server: RedisServer, tmp_path: Path, prefix: str
) -> None:
    """An older adapter sharing the server loaded ``ba_screen_1`` without admission: the
    first read that finds its reply short loads this one, and the published item moves."""
    keys, client = Keys(prefix), connect(server.url)
    start = SOURCE.index("  if keys[3] then")
    older = SOURCE[:start] + SOURCE[SOURCE.index("  local st = {", start) :]
    older = older.replace("{}, admitted}", "{}}")
    client.execute_command("FUNCTION", "LOAD", "REPLACE", older)  # type: ignore[no-untyped-call]
    tasks = TaskStore(open_database(tmp_path / "inbox.db"), FakeClock())
    config = IngestConfig(prefix=prefix, consumer="ingest-old-0", block_ms=20)
    ingestor = Ingestor(config, client, tasks, Keyring(KEYRING))
    Publisher(client, keys, "alice", Keyring(KEYRING)).publish(envelope("moved"))
    for _ in range(3):
        ingestor.step()
    assert client.llen(keys.submit()) == 0
    assert task_counts(tasks) == {("alice", "moved"): 1}
