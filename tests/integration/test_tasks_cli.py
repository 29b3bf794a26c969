"""The operator's commands by the ids they know, as subprocesses against a real redis-server
and adapter: ``publish`` prints what it knows, ``result`` prints the recorded reply (exit 3
while there is none, saying pending/running/unknown with ``--db``), ``tasks list`` and
``tasks show`` find tasks, ``cancel --message-id --principal`` names a task by message id."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.protocol.signing import Keyring
from tests.support.cli import count_rows, publish, wait_for
from tests.support.cli import run_cli as _cli
from tests.support.client_adapter import running_adapter
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration


def _lines(res: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in res.stdout.splitlines()]


def test_publish_result_tasks_and_cancel_by_message_id(
    redis_server: RedisServer, tmp_path: Path, keyring: Keyring, prefix: str
) -> None:
    db, keys = tmp_path / "a.db", str(tmp_path / "keys.json")
    common = ["--redis", redis_server.url, "--prefix", prefix]
    with running_adapter(redis_server.url, db, Path(keys), prefix):
        printed = publish(redis_server.url, keys, prefix, "m 1", {"a": 1})
        assert printed["key_id"] == "alice-2026"
        assert printed["reply_stream"] == f"{prefix}:{{out.alice}}:replies"
        assert printed["result"] == "broker-adapter result --principal alice --id 'm 1'"
        assert printed["max_attempts"] == 3
        wait_for(
            lambda: count_rows(db, "SELECT count(*) FROM tasks WHERE state = 'done'"),
            "the task done",
        )
        wait_for(
            lambda: count_rows(db, "SELECT count(*) FROM outbox WHERE state = 'sent'"),
            "its reply sent",
        )
    res = _cli("result", *common, "--principal", "alice", "--keyring", keys, "--id", "m 1")
    assert res.returncode == 0, res.stderr
    (shown,) = _lines(res)
    assert shown["state"] == "done"
    assert shown["reply"]["result"] == {"echo": {"a": 1}, "message_id": "m 1"}
    none = _cli(
        "result",
        *common,
        "--principal",
        "alice",
        "--keyring",
        keys,
        "--id",
        "nope",
        "--db",
        str(db),
    )
    assert none.returncode == 3
    assert _lines(none) == [
        {"principal": "alice", "message_id": "nope", "state": "unknown", "reply": None}
    ]

    listed = _lines(
        _cli("tasks", "list", "--db", str(db), "--state", "done", "--principal", "alice")
    )
    assert [(t["message_id"], t["state"]) for t in listed] == [("m 1", "done")]
    assert _lines(_cli("tasks", "list", "--db", str(db), "--principal", "bob")) == []
    bad = _cli("tasks", "list", "--db", str(db), "--state", "finished")
    assert bad.returncode == 2
    assert "no task state 'finished'" in bad.stderr
    (by_mid,) = _lines(_cli("tasks", "show", "--db", str(db), "m 1"))
    (by_tid,) = _lines(_cli("tasks", "show", "--db", str(db), by_mid["task_id"]))
    assert by_mid == by_tid
    assert json.loads(by_mid["payload"]) == {"a": 1}

    done = _cli("cancel", "--db", str(db), "--message-id", "m 1", "--principal", "alice")
    assert done.returncode == 0, done.stderr
    (ended,) = _lines(done)
    assert "(os user " in ended.pop("by")  # who cancelled is recorded
    assert ended == {"task_id": by_mid["task_id"], "state": "done"}  # already ended
    assert _cli("cancel", "--db", str(db), "--message-id", "m 1").returncode == 2
    missing = _cli("cancel", "--db", str(db), "--message-id", "zz", "--principal", "alice")
    assert missing.returncode == 2
    assert "'alice' has no request 'zz'" in missing.stderr
