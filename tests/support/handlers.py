"""Sample handlers for tests, loadable as ``tests.support.handlers:<name>``.

``record_effect`` stands for an external system that checks idempotency keys (docs/RULES.md
rule 16): a SQLite file of its own (path in the payload's ``effects_db``) with an ``effects``
table keyed by the idempotency key (an effect is applied once) and an append-only
``attempts`` ledger (every call is recorded, so a test can see a handler ran twice while the
effect happened once).
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

from broker_adapter.errors import RetryableError
from broker_adapter.handler.task import Task

NOT_CALLABLE = {"a": "dict"}  # for load_handler's "not callable" message
EFFECTS_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS effects (idempotency_key TEXT PRIMARY KEY, task_id TEXT NOT NULL,"
    " fence INTEGER NOT NULL, attempt INTEGER NOT NULL, value TEXT)",
    "CREATE TABLE IF NOT EXISTS attempts (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
    " idempotency_key TEXT NOT NULL, task_id TEXT NOT NULL, fence INTEGER NOT NULL,"
    " attempt INTEGER NOT NULL, owner TEXT NOT NULL)",
)


class UpstreamBusy(Exception):
    """Not a ``RetryableError``, but marked retryable by attribute."""

    retryable = True


def ok(task: Task) -> dict[str, Any]:
    """Echo the payload."""
    return {"echo": task.payload, "attempt": task.attempt}


def flaky(task: Task) -> dict[str, Any]:
    """Raise ``RetryableError`` until attempt ``payload["ok_on_attempt"]`` (default 2)."""
    if task.attempt < int(task.payload.get("ok_on_attempt", 2)):
        raise RetryableError(f"upstream unavailable on attempt {task.attempt}")
    return {"attempt": task.attempt}


def busy(task: Task) -> None:
    """Raise an exception that is retryable by attribute."""
    raise UpstreamBusy("try later")


def always_fail(task: Task) -> None:
    """Raise a non-retryable error."""
    raise ValueError(f"cannot handle {task.payload!r}")


def slow(task: Task) -> dict[str, Any]:
    """Take up to ``payload["seconds"]`` (default 3600), returning early once cancelled."""
    stopped = task.wait_cancelled(float(task.payload.get("seconds", 3600.0)))
    return {"stopped": stopped}


def non_json(task: Task) -> set[int]:
    """Return something JSON cannot carry."""
    return {1, 2, 3}


async def async_ok(task: Task) -> dict[str, Any]:
    """An ``async def`` handler."""
    await asyncio.sleep(0)
    return {"async": True, "echo": task.payload}


async def async_hang(task: Task) -> None:
    """Wait forever (until the worker's timeout cancels the coroutine)."""
    await asyncio.Event().wait()


def needs_two(task: Task, extra: str) -> None:
    """Wrong arity, for load_handler's message."""


class Namespace:
    """A handler reached by a dotted attribute path."""

    @staticmethod
    def ok(task: Task) -> str:
        return "ok"


def init_effects_db(path: str | Path) -> None:
    """Create the effects database (WAL, so several worker processes can write it)."""
    with closing(sqlite3.connect(str(path), isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        for statement in EFFECTS_SCHEMA:
            conn.execute(statement)


def record_effect(task: Task) -> dict[str, Any]:
    """Apply one effect keyed by the idempotency key; log the attempt in the ledger."""
    path = str(task.payload["effects_db"])
    with closing(sqlite3.connect(path, timeout=10.0, isolation_level=None)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in EFFECTS_SCHEMA:
                conn.execute(statement)
            conn.execute(
                "INSERT INTO attempts (idempotency_key, task_id, fence, attempt, owner)"
                " VALUES (?, ?, ?, ?, ?)",
                (task.idempotency_key, task.task_id, task.fence, task.attempt, task.owner),
            )
            conn.execute(
                "INSERT INTO effects (idempotency_key, task_id, fence, attempt, value)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (idempotency_key) DO NOTHING",
                (
                    task.idempotency_key,
                    task.task_id,
                    task.fence,
                    task.attempt,
                    str(task.payload.get("value")),
                ),
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return {"key": task.idempotency_key, "value": task.payload.get("value")}


def effects(path: str | Path) -> dict[str, int]:
    """Effects applied, by idempotency key (each count is 1 by construction)."""
    with closing(sqlite3.connect(str(path))) as conn:
        rows = conn.execute(
            "SELECT idempotency_key, count(*) FROM effects GROUP BY idempotency_key"
        ).fetchall()
    return {str(k): int(n) for k, n in rows}


def ledger(path: str | Path) -> list[tuple[str, int, int, str]]:
    """Every recorded call: ``(idempotency_key, fence, attempt, owner)`` in call order."""
    with closing(sqlite3.connect(str(path))) as conn:
        rows = conn.execute(
            "SELECT idempotency_key, fence, attempt, owner FROM attempts ORDER BY seq"
        ).fetchall()
    return [(str(k), int(f), int(a), str(o)) for k, f, a, o in rows]


def held_or_failing(task: Task) -> dict[str, Any]:
    """Echo the payload. ``payload["hold"]``, a file path: on the first attempt write this
    process's pid there and wait (to be killed); ``payload["fail"]``: raise ``ValueError``
    (not retryable) with a message that names no payload."""
    if task.payload.get("fail"):
        raise ValueError("this task asks to fail")
    hold = task.payload.get("hold")
    if hold and task.attempt == 1:
        tmp = Path(f"{hold}.tmp")
        tmp.write_text(str(os.getpid()))
        tmp.rename(hold)
        task.wait_cancelled(3600.0)
    return {"echo": task.payload}


def held_record(task: Task) -> dict[str, Any]:
    """``record_effect`` after holding the task ``payload["hold_s"]`` seconds (returning
    early if cancelled): a handler that is still running while another host looks at its
    lease."""
    task.wait_cancelled(float(task.payload.get("hold_s", 0.0)))
    return record_effect(task)
