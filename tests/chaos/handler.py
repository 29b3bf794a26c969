"""The chaos run's task handler, loadable as ``tests.chaos.handler:handle``.

It stands for an external system that checks idempotency keys (docs/RULES.md rule 16), kept in
a SQLite file of its own (``CHAOS_EFFECTS_DB``, or ``payload["effects_db"]``):

* ``attempts``: an append-only ledger, one row per call and event (``start``, ``effect``,
  ``retry``, ``poison``, ``crash``), so the checker sees re-executions;
* ``effects``: one row per ``task.idempotency_key``; a second application of the same key
  is absorbed (``applications`` + 1, ``last_fence`` raised), never a second row.

The payload's ``kind`` picks the behaviour:

* ``ok``, ``dup`` targets, ``deadline``: apply the effect and return;
* ``transient``: attempt 1 raises ``RetryableError``, later attempts succeed;
* ``slow``, ``slow_long``, ``cancel``: wait ``sleep_s`` (returning early once the task is
  cancelled or its lease lost), then apply the effect (a zombie's late effect is absorbed);
* ``poison``: always fails (``RetryableError`` when ``retryable`` is true, else ``ValueError``);
* ``crash``: attempt 1 SIGKILLs its own worker process, later attempts succeed.

Every successful call returns ``{"fence", "attempt", "value"}``: the fence in the result is
how the checker sees which claim committed (a stale commit shows a fence below the task's).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from broker_adapter.errors import RetryableError
from broker_adapter.handler.task import Task

ENV_EFFECTS_DB = "CHAOS_EFFECTS_DB"
BUSY_TIMEOUT_S = 30.0

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS attempts (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
    " t REAL NOT NULL, wall REAL NOT NULL, idempotency_key TEXT NOT NULL,"
    " task_id TEXT NOT NULL, principal TEXT NOT NULL, message_id TEXT NOT NULL,"
    " fence INTEGER NOT NULL, attempt INTEGER NOT NULL, owner TEXT NOT NULL,"
    " pid INTEGER NOT NULL, kind TEXT NOT NULL, event TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS effects (idempotency_key TEXT PRIMARY KEY,"
    " task_id TEXT NOT NULL, principal TEXT NOT NULL, message_id TEXT NOT NULL,"
    " first_fence INTEGER NOT NULL, last_fence INTEGER NOT NULL,"
    " applications INTEGER NOT NULL, value TEXT, wall REAL NOT NULL)",
)


def init_db(path: str | Path) -> None:
    """Create the effects database (WAL: worker processes of two adapters write it)."""
    with closing(sqlite3.connect(str(path), isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        for statement in SCHEMA:
            conn.execute(statement)


def _db_path(task: Task) -> str:
    path = os.environ.get(ENV_EFFECTS_DB) or task.payload.get("effects_db")
    if not path:
        raise ValueError(f"no effects database: set {ENV_EFFECTS_DB}")
    return str(path)


def _write(task: Task, event: str, *, effect: bool) -> None:
    """One short transaction: a ledger row, plus the keyed effect when ``effect``."""
    kind = str(task.payload.get("kind", "ok"))
    try:
        with closing(
            sqlite3.connect(_db_path(task), timeout=BUSY_TIMEOUT_S, isolation_level=None)
        ) as conn:
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute(
                    "INSERT INTO attempts (t, wall, idempotency_key, task_id, principal,"
                    " message_id, fence, attempt, owner, pid, kind, event)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        time.monotonic(),
                        time.time(),
                        task.idempotency_key,
                        task.task_id,
                        task.principal,
                        task.message_id,
                        task.fence,
                        task.attempt,
                        task.owner,
                        os.getpid(),
                        kind,
                        event,
                    ),
                )
                if effect:
                    conn.execute(
                        "INSERT INTO effects (idempotency_key, task_id, principal, message_id,"
                        " first_fence, last_fence, applications, value, wall)"
                        " VALUES (?, ?, ?, ?, ?, ?, 1, ?, ?)"
                        " ON CONFLICT (idempotency_key) DO UPDATE SET"
                        " applications = applications + 1,"
                        " last_fence = max(last_fence, excluded.last_fence)",
                        (
                            task.idempotency_key,
                            task.task_id,
                            task.principal,
                            task.message_id,
                            task.fence,
                            task.fence,
                            str(task.payload.get("value")),
                            time.time(),
                        ),
                    )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
    except sqlite3.OperationalError as exc:
        # The effects system being busy (a paused worker holds its lock) is worth a retry.
        raise RetryableError(f"effects database busy: {exc}") from exc


def _result(task: Task) -> dict[str, Any]:
    return {"fence": task.fence, "attempt": task.attempt, "value": task.payload.get("value")}


def handle(task: Task) -> dict[str, Any]:
    """Run one chaos task; see the module docstring for the kinds."""
    kind = str(task.payload.get("kind", "ok"))
    _write(task, "start", effect=False)
    if kind == "transient" and task.attempt == 1:
        _write(task, "retry", effect=False)
        raise RetryableError("transient failure on attempt 1, on purpose")
    if kind == "crash" and task.attempt == 1:
        _write(task, "crash", effect=False)
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "poison":
        _write(task, "poison", effect=False)
        if task.payload.get("retryable"):
            raise RetryableError("poison task: always fails (retryable)")
        raise ValueError("poison task: always fails")
    if kind in ("slow", "slow_long", "cancel"):
        task.wait_cancelled(float(task.payload.get("sleep_s", 3.0)))
    _write(task, "effect", effect=True)
    return _result(task)
