"""Cancel over the wire against a real redis-server and adapter subprocess: a ``cancel``
envelope stops the sender's pending task (its reply says ``cancelled``) and asks a running
one to stop; another principal's cancel is refused and dead-lettered with a reason, and the
task it named runs on."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from broker_adapter import AsyncClient, Envelope, Keyring, Publisher, RequestCancelled
from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import connect, text
from tests.support.cli import count_rows, wait_for
from tests.support.client_adapter import running_adapter
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration


def _state(db: Path, message_id: str) -> int:
    return count_rows(
        db, f"SELECT count(*) FROM tasks WHERE message_id = '{message_id}' AND state = 'running'"
    )


async def _cancel_pending_and_running(url: str, keyring: Keyring, prefix: str, db: Path) -> None:
    async with AsyncClient(url, "alice", keyring, prefix=prefix, instance="c1") as client:
        slow = asyncio.create_task(
            client.request(None, {"seconds": 60}, message_id="busy", timeout_s=60)
        )
        await asyncio.to_thread(wait_for, lambda: _state(db, "busy"), "the slow task running")
        waiting = asyncio.create_task(
            client.request(None, {"x": 1}, message_id="queued", timeout_s=60)
        )
        await asyncio.to_thread(
            wait_for,
            lambda: count_rows(db, "SELECT count(*) FROM tasks WHERE message_id = 'queued'"),
            "the queued task stored",
        )
        assert await client.cancel("queued") == "cancel-" + _sha("queued")
        with pytest.raises(RequestCancelled) as pending:
            await waiting
        assert pending.value.reply.status == "cancelled"
        assert pending.value.reply.attempts == 0  # it never ran
        await client.cancel("busy")  # running: asked to stop; the handler returns early
        reply = await slow
        assert reply.result == {"stopped": True}, reply  # True only once the cancel was seen


def _sha(text_: str) -> str:
    import hashlib

    return hashlib.sha256(text_.encode()).hexdigest()[:40]


def test_cancel_stops_a_pending_task_and_asks_a_running_one_to_stop(
    redis_server: RedisServer, tmp_path: Path, keyring: Keyring, prefix: str
) -> None:
    db = tmp_path / "a.db"
    with running_adapter(redis_server.url, db, tmp_path / "keys.json", prefix, workers=1):
        asyncio.run(_cancel_pending_and_running(redis_server.url, keyring, prefix, db))
    assert count_rows(db, "SELECT count(*) FROM tasks WHERE state = 'cancelled'") == 1
    assert count_rows(db, "SELECT count(*) FROM tasks WHERE cancel_requested_at IS NOT NULL") == 1


def _dead_letters(client: Any, stream: str) -> list[dict[str, str]]:
    return [{text(k): text(v) for k, v in f.items()} for _, f in client.xrange(stream)]


def test_another_principals_cancel_is_refused_and_dead_lettered(
    redis_server: RedisServer, tmp_path: Path, keyring: Keyring, prefix: str
) -> None:
    db = tmp_path / "a.db"
    keys = Keys(prefix)
    r: Any = connect(redis_server.url)
    bob = Publisher(r, keys, "bob", keyring)
    deadline = time.time() + 300
    with running_adapter(redis_server.url, db, tmp_path / "keys.json", prefix, workers=1):
        alice = Publisher(r, keys, "alice", keyring)
        alice.publish(
            Envelope(
                message_id="a-slow", sender="alice", payload={"seconds": 60}, deadline=deadline
            )
        )
        wait_for(lambda: _state(db, "a-slow"), "alice's task running")
        for mid, payload in [
            ("bob-c1", {"message_id": "a-slow", "principal": "alice"}),  # names alice: refused
            ("bob-c2", {"message_id": "a-slow"}),  # bob has no such request
            ("bob-c3", {"id": "a-slow"}),  # not a cancel's payload
        ]:
            bob.publish(
                Envelope(
                    message_id=mid, sender="bob", kind="cancel", payload=payload, deadline=deadline
                )
            )
        dead = keys.inbound_dead()
        wait_for(lambda: len(_dead_letters(r, dead)) == 3, "three dead letters")
        letters = _dead_letters(r, dead)
        assert [(d["dl.reason"], d["dl.field"], d["dl.principal"]) for d in letters] == [
            ("not_owner", "payload", "bob"),
            ("unknown_task", "payload", "bob"),
            ("bad_cancel", "payload", "bob"),
        ]
        assert "'bob' cannot cancel a request of 'alice'" in letters[0]["dl.detail"]
        assert _state(db, "a-slow") == 1  # alice's task runs on, no cancel requested
        assert (
            count_rows(db, "SELECT count(*) FROM tasks WHERE cancel_requested_at IS NOT NULL") == 0
        )
        # alice's own cancel is applied: her running task is asked to stop
        alice.publish(
            Envelope(
                message_id="a-c1",
                sender="alice",
                kind="cancel",
                payload={"message_id": "a-slow"},
                deadline=deadline,
            )
        )
        wait_for(
            lambda: (
                count_rows(
                    db,
                    "SELECT count(*) FROM tasks WHERE cancel_requested_at"
                    " IS NOT NULL AND state != 'running'",
                )
                == 1
            ),
            "alice's task stopped on her cancel",
        )
    assert count_rows(db, "SELECT count(*) FROM tasks") == 1  # cancels never become tasks
