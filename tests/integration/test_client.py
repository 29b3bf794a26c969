"""``Client`` / ``AsyncClient`` against a real redis-server and a real adapter subprocess:
a request returns its verified reply; a failed task raises ``RequestFailed`` carrying the
reply; six requester processes of one principal, each with requests in flight at once, each
get exactly their own replies; a requester SIGKILLed while waiting collects its reply with
``result`` after a restart; a publish whose acknowledgement was lost (its connection killed
after the RPUSH) is resent and still makes one task and one reply."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio

from broker_adapter import AsyncClient, Client, Keyring, RequestFailed, RequestTimeout
from broker_adapter.errors import ConfigError, EnvelopeError
from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import connect
from tests.support.cli import cli_env, count_rows, wait_for
from tests.support.client_adapter import ROOT, running_adapter
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture
def keyring_path(keyring: Keyring, tmp_path: Path) -> Path:
    return tmp_path / "keys.json"  # written by the ``keyring`` fixture


def _tasks(db: Path, where: str = "1=1") -> int:
    return count_rows(db, f"SELECT count(*) FROM tasks WHERE {where}")


def test_sync_client_request_returns_the_reply_and_a_failure_raises_with_it(
    redis_server: RedisServer, tmp_path: Path, keyring: Keyring, keyring_path: Path, prefix: str
) -> None:
    db = tmp_path / "a.db"
    with (
        running_adapter(redis_server.url, db, keyring_path, prefix),
        Client(redis_server.url, "alice", keyring, instance="sync-1", prefix=prefix) as client,
    ):
        reply = client.request(None, {"x": 1}, message_id="sync-ok", timeout_s=60)
        assert reply.status == "done"
        assert reply.message_id == "sync-ok"
        assert reply.result == {"echo": {"x": 1}, "message_id": "sync-ok"}
        with pytest.raises(RequestFailed) as failed:
            client.request(None, {"fail": "no disk"}, key="restart-web", timeout_s=60)
        assert failed.value.reply.status == "failed"
        assert "no disk" in (failed.value.reply.error or "")
        assert failed.value.message_id == client.message_id(key="restart-web")
        # the recorded reply of each, by message id
        recorded = client.result("sync-ok")
        assert recorded is not None
        assert recorded.reply_id == reply.reply_id
        assert client.result("never-sent") is None


def test_request_arguments_are_checked_before_anything_is_sent(
    redis_server: RedisServer, keyring: Keyring, prefix: str
) -> None:
    with Client(redis_server.url, "alice", keyring, prefix=prefix) as client:
        with pytest.raises(EnvelopeError, match="task"):
            client.request("no spaces allowed", {}, message_id="m")
        with pytest.raises(ConfigError, match="message_id= or key="):
            client.request(None, {})
        with pytest.raises(ConfigError, match="message_id= or key="):
            client.request(None, {}, message_id="m", key="k")
        with pytest.raises(RequestTimeout, match="'quiet'"):  # no adapter runs
            client.request(None, {}, message_id="quiet", timeout_s=0.3)
    assert Client(redis_server.url, "alice", keyring).instance  # a default instance id


def _requester(url: str, prefix: str, keyring: Path, instance: str, *args: str) -> Any:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.requester_script",
            url,
            prefix,
            str(keyring),
            instance,
            *args,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )


def test_six_instances_of_one_principal_each_get_exactly_their_own_replies(
    redis_server: RedisServer, tmp_path: Path, keyring: Keyring, keyring_path: Path, prefix: str
) -> None:
    db = tmp_path / "a.db"
    n = 5
    with running_adapter(redis_server.url, db, keyring_path, prefix, workers=3):
        procs = {
            f"inst{i}": _requester(redis_server.url, prefix, keyring_path, f"inst{i}", str(n))
            for i in range(6)
        }
        outputs = {name: p.communicate(timeout=120) for name, p in procs.items()}
    for name, (out, err) in outputs.items():
        assert procs[name].returncode == 0, err
        lines = [json.loads(line) for line in out.splitlines()]
        replies = [line for line in lines if "status" in line]
        assert len(replies) == n, out
        for line in replies:  # its own replies, none timed out
            assert line["status"] == "done", line
            assert line["echo_of"] == line["key"]
            assert line["key"].startswith(f"{name}-")
    assert _tasks(db) == 6 * n


def test_a_requester_killed_while_waiting_collects_its_reply_with_result_after_a_restart(
    redis_server: RedisServer, tmp_path: Path, keyring: Keyring, keyring_path: Path, prefix: str
) -> None:
    db = tmp_path / "a.db"
    with running_adapter(redis_server.url, db, keyring_path, prefix):
        proc = _requester(redis_server.url, prefix, keyring_path, "crashy", "2", "1")
        assert proc.stdout is not None
        sent = [json.loads(proc.stdout.readline())["sent"] for _ in range(2)]
        wait_for(lambda: _tasks(db, "state = 'running'") >= 1, "a task running")
        proc.kill()  # SIGKILL while waiting
        proc.wait()
        proc.stdout.close()
        assert proc.stderr is not None
        proc.stderr.close()
        wait_for(lambda: _tasks(db, "state = 'done'") == 2, "both tasks done")
        again = _requester(redis_server.url, prefix, keyring_path, "crashy", "result", *sent)
        out, err = again.communicate(timeout=60)
    assert again.returncode == 0, err
    assert [json.loads(line) for line in out.splitlines()] == [
        {"message_id": mid, "status": "done"} for mid in sent
    ]


async def _lost_ack_request(
    url: str, keyring: Keyring, prefix: str, resent: threading.Event
) -> tuple[Any, int]:
    """One request whose first publish reaches the submit list but whose answer is lost: the
    connection is killed (CLIENT KILL) right after the RPUSH ran. ``resent`` is set once the
    client has pushed the same envelope again."""
    conn: Any = redis.asyncio.Redis.from_url(url, socket_timeout=15)
    admin: Any = redis.asyncio.Redis.from_url(url)
    real_rpush = conn.rpush
    lost = pushes = 0

    async def rpush(*args: Any, **kwargs: Any) -> Any:
        nonlocal lost, pushes
        entry = await real_rpush(*args, **kwargs)
        pushes += 1
        if lost == 0:
            lost += 1
            for c in await admin.client_list():
                if c.get("cmd") == "rpush" or c.get("name") == "lost-ack":
                    await admin.client_kill_filter(_id=c["id"])
            raise redis.ConnectionError("connection killed after the RPUSH ran")
        if pushes >= 2:
            resent.set()
        return entry

    await conn.client_setname("lost-ack")
    conn.rpush = rpush
    client = AsyncClient(conn, "alice", keyring, prefix=prefix, resend_after_s=0.2)
    try:
        reply = await client.request(None, {"v": 1}, message_id="lost-ack-1", timeout_s=60)
    finally:
        await client.aclose()
        await conn.aclose()
        await admin.aclose()
    return reply, lost


def test_a_request_whose_publish_acknowledgement_was_lost_makes_one_task_and_one_reply(
    redis_server: RedisServer, tmp_path: Path, keyring: Keyring, keyring_path: Path, prefix: str
) -> None:
    """The adapter starts only once the client has pushed the envelope a second time, so
    both copies reach the inbound stream whatever the timing."""
    db = tmp_path / "a.db"
    keys = Keys(prefix)
    resent = threading.Event()
    outcome: list[tuple[Any, int]] = []
    requester = threading.Thread(
        target=lambda: outcome.append(
            asyncio.run(_lost_ack_request(redis_server.url, keyring, prefix, resent))
        )
    )
    requester.start()
    try:
        assert resent.wait(timeout=30), "the client never sent the envelope again"
        with running_adapter(redis_server.url, db, keyring_path, prefix):
            requester.join(timeout=90)
            assert outcome, "the request did not return"
            reply, lost = outcome[0]
            assert lost == 1
            assert reply.status == "done"
            wait_for(
                lambda: count_rows(db, "SELECT count(*) FROM outbox WHERE state = 'sent'"),
                "the reply marked sent",
            )
    finally:
        requester.join(timeout=90)
    r: Any = connect(redis_server.url)
    inbound = [f for _, f in r.xrange(keys.inbound())]
    assert len(inbound) >= 2  # the lost one and at least one resend, the same bytes
    assert len({f[b"env"] for f in inbound}) == 1
    assert _tasks(db) == 1
    replies = [f for _, f in r.xrange(keys.replies("alice")) if b"lost-ack-1" in f[b"body"]]
    assert len(replies) == 1
