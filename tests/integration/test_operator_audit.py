"""Operator commands as real processes: each names the operating-system user from the
password database by the real user id, never from ``$USER``/``$LOGNAME``; ``cancel`` keeps
who asked with the task; the numbers an operator types are bounded on both sides."""

from __future__ import annotations

import json
import os
import pwd
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.app.effects_cli import MAX_APPROVAL_S
from broker_adapter.clock import SystemClock
from broker_adapter.store import TaskStore, open_database
from broker_adapter.store.inbox import AcceptItem
from tests.support.cli import cli_env, run_cli
from tests.support.ingest_script import envelope, real_deadline

pytestmark = pytest.mark.integration

REAL_USER = pwd.getpwuid(os.getuid()).pw_name
FAKE = {"USER": "mallory-not-me", "LOGNAME": "mallory-not-me"}


def _cli(*args: str) -> Any:
    return run_cli(*args, env=cli_env(**FAKE))


def test_cancel_records_who_ran_it_with_the_real_os_user(tmp_path: Path) -> None:
    path = tmp_path / "adapter.db"
    db = open_database(path)
    tasks = TaskStore(db, SystemClock())
    (result,) = tasks.accept([AcceptItem("alice", envelope("m1", deadline=real_deadline()))])
    task_id = result.task_id
    assert task_id is not None
    db.close()
    res = _cli("cancel", "--db", str(path), task_id, "--by", "carol")
    assert res.returncode == 0, res.stderr
    by = f"carol (os user {REAL_USER})"
    assert json.loads(res.stdout)["by"] == by
    assert f"audit: cancel by os user {REAL_USER}" in res.stderr
    assert "mallory" not in res.stdout + res.stderr
    db = open_database(path)
    row = TaskStore(db, SystemClock()).get(task_id)
    db.close()
    assert row is not None
    assert row.error is not None
    assert f"[by {by}]" in row.error
    res = _cli("cancel", "--db", str(path), task_id, "--reason", "x" * 1001)
    assert res.returncode == 2
    assert "--reason must be 1..1000" in res.stderr


def test_expires_in_and_interval_are_bounded(tmp_path: Path) -> None:
    path = tmp_path / "adapter.db"
    open_database(path).close()

    def approve(seconds: str) -> Any:
        return _cli(
            "approve",
            "--db",
            str(path),
            "apply",
            "--target",
            "web1",
            "--scope",
            "s",
            "--principal",
            "alice",
            "--arguments",
            "{}",
            "--expires-in",
            seconds,
            "--by",
            "carol",
        )

    for bad in ("inf", "nan", "0", "-1", str(MAX_APPROVAL_S + 1)):
        res = approve(bad)
        assert res.returncode == 2, bad
        assert "--expires-in must be above 0" in res.stderr
    res = approve(str(MAX_APPROVAL_S))
    assert res.returncode == 0, res.stderr
    assert f"audit: approve by os user {REAL_USER}" in res.stderr
    res = _cli("status", "--db", str(path), "--watch", "--interval", "inf")
    assert res.returncode == 2
    assert "--interval must be above 0" in res.stderr
