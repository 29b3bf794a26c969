"""Finding tasks by the ids an operator knows: a list filtered by state and principal, and
one task by its task id or by its message id (``broker-adapter tasks``). Reads only."""

from __future__ import annotations

from typing import Any

from broker_adapter.errors import ConfigError
from broker_adapter.store.sql import Db
from broker_adapter.store.task_types import TaskState

#: What a listed task shows (the payload and result stay out of the list).
LIST_COLUMNS = (
    "task_id",
    "principal",
    "message_id",
    "state",
    "attempts",
    "max_attempts",
    "created_at",
    "updated_at",
    "deadline",
    "finished_at",
    "error",
)
#: What ``show`` adds.
SHOW_COLUMNS = (
    *LIST_COLUMNS,
    "kind",
    "payload",
    "result",
    "fingerprint",
    "correlation_id",
    "parent_id",
    "hops",
    "owner",
    "fence",
    "lease_until",
    "not_before",
    "cancel_requested_at",
    "traceparent",
)
MAX_LIST = 10_000


def list_tasks(
    db: Db, *, state: str | None = None, principal: str | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    """Tasks, newest first, at most ``limit`` (1..``MAX_LIST``).

    Raises:
        ConfigError: ``state`` is not a task state, or ``limit`` out of range.
    """
    if state is not None and state not in TaskState.__members__.values():
        known = ", ".join(s.value for s in TaskState)
        raise ConfigError(f"no task state {state!r} (one of {known})")
    if not 1 <= limit <= MAX_LIST:
        raise ConfigError(f"--limit must be 1..{MAX_LIST}, not {limit}")
    where, params = [], []
    if state is not None:
        where.append("state = ?")
        params.append(state)
    if principal is not None:
        where.append("principal = ?")
        params.append(principal)
    sql = f"SELECT {', '.join(LIST_COLUMNS)} FROM tasks"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY created_at DESC, task_id DESC LIMIT ?"
    with db.read() as c:
        rows = c.execute(sql, (*params, limit)).fetchall()
    return [dict(zip(LIST_COLUMNS, tuple(r), strict=True)) for r in rows]


def show_tasks(db: Db, ident: str, principal: str | None = None) -> list[dict[str, Any]]:
    """The task whose task id is ``ident``, else the tasks whose message id is ``ident``
    (one per principal that used it; only ``principal``'s when given)."""
    cols = ", ".join(SHOW_COLUMNS)
    with db.read() as c:
        rows = c.execute(f"SELECT {cols} FROM tasks WHERE task_id = ?", (ident,)).fetchall()
        if not rows:
            sql = f"SELECT {cols} FROM tasks WHERE message_id = ?"
            params: tuple[str, ...] = (ident,)
            if principal is not None:
                sql, params = sql + " AND principal = ?", (ident, principal)
            rows = c.execute(sql + " ORDER BY principal", params).fetchall()
    return [dict(zip(SHOW_COLUMNS, tuple(r), strict=True)) for r in rows]
