"""Fences at the target: a resource we can reach refuses a write from an older attempt.

The store fences its own tables (``docs/RULES.md`` rule 10), but a worker frozen past its
lease (a zombie) may still reach an external system before its commit is refused: its late
effect lands after the new holder's. A target we can write to conditionally can refuse it
itself: it keeps the highest fence seen per key and applies a write only if the writer's
fence is not lower, in the same transaction (SQL) or script (Redis) as the write.

The key must be one per task (the task id, or the task id and the resource): fences count
the claims of one task, so the fences of two tasks are not ordered. An equal fence is
accepted (the same attempt writing again, e.g. after a lost response); a lower one raises
``TargetFenced``. A fence record must outlive any zombie of its task: delete it with the
resource, or once the task is terminal and past its lease.

This module holds the SQL variant, for any DB-API 2.0 connection (the caller's own
transaction, the caller's driver: it imports none); the Redis variant is
``broker_adapter.redis.fences``.

Example (sqlite3, in the target's transaction)::

    fence = SqlFence()
    with conn:                                   # one transaction: check and effect
        fence.advance(conn.cursor(), task.task_id, task.fence)   # TargetFenced: roll back
        conn.execute("UPDATE servers SET state = 'restarting' WHERE name = ?", ("web1",))
"""

from __future__ import annotations

import re
from typing import Any, Literal, Protocol

from broker_adapter.errors import StaleError

ParamStyle = Literal["qmark", "format", "pyformat", "numeric"]
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


class TargetFenced(StaleError):
    """A target refused a write: it has seen a higher fence for that key.

    Attributes:
        key: the fence key.
        fence: the fence presented.
        highest: the highest fence the target had seen.
    """

    def __init__(self, key: str, fence: int, highest: int) -> None:
        self.key = key
        self.fence = fence
        self.highest = highest
        super().__init__(key, "fence", f"target saw fence {highest}, write had {fence}")


class FenceCursor(Protocol):
    """The part of a DB-API 2.0 cursor ``SqlFence`` uses."""

    @property
    def rowcount(self) -> int: ...

    def execute(self, operation: Any, parameters: Any = ..., /) -> Any: ...

    def fetchone(self) -> Any: ...


def check_fence(fence: int) -> int:
    """``fence`` if it is a fence (an integer >= 0, not a bool).

    Raises:
        ValueError: it is not.
    """
    if isinstance(fence, bool) or not isinstance(fence, int) or fence < 0:
        raise ValueError(f"a fence is an integer >= 0, got {fence!r}")
    return fence


class SqlFence:
    """The highest fence per key, in a table of the target's database.

    Args:
        table: the table's name (letters, digits, ``_``); columns ``fence_key`` (text,
            primary key) and ``fence`` (integer). ``create_sql`` makes it.
        paramstyle: the driver's placeholder style (its module's ``paramstyle``):
            ``qmark`` (sqlite3), ``format`` / ``pyformat`` (psycopg, MySQLdb), ``numeric``.

    Raises:
        ValueError: a table name that is not a plain identifier, or an unknown style.
    """

    def __init__(self, table: str = "ba_fences", *, paramstyle: ParamStyle = "qmark") -> None:
        if not _NAME.fullmatch(table):
            raise ValueError(f"table must be a plain SQL identifier, got {table!r}")
        if paramstyle not in ("qmark", "format", "pyformat", "numeric"):
            raise ValueError(f"unknown paramstyle {paramstyle!r}")
        self.table = table

        def marks(n: int) -> list[str]:  # the placeholders of n positional parameters
            if paramstyle == "qmark":
                return ["?"] * n
            if paramstyle == "numeric":
                return [f":{i}" for i in range(1, n + 1)]
            return ["%s"] * n

        a, b, c = marks(3)
        self._update = f"UPDATE {table} SET fence = {a} WHERE fence_key = {b} AND fence <= {c}"
        # Insert-if-absent in standard SQL (no ON CONFLICT / INSERT IGNORE dialects).
        self._insert = (
            f"INSERT INTO {table} (fence_key, fence) SELECT {a}, {b}"
            f" WHERE NOT EXISTS (SELECT 1 FROM {table} WHERE fence_key = {c})"
        )
        self._select = f"SELECT fence FROM {table} WHERE fence_key = {marks(1)[0]}"

    def create_sql(self) -> str:
        """The ``CREATE TABLE IF NOT EXISTS`` statement of the fence table."""
        return (
            f"CREATE TABLE IF NOT EXISTS {self.table}"
            " (fence_key VARCHAR(255) PRIMARY KEY, fence BIGINT NOT NULL)"
        )

    def advance(self, cursor: FenceCursor, key: str, fence: int) -> None:
        """Accept ``fence`` for ``key`` (recording it as the highest) or refuse it, inside
        the caller's transaction: the caller makes its write after this, in the same
        transaction, and rolls back on ``TargetFenced``.

        Two first writers of a new key may race to insert it; the loser's driver raises its
        integrity error (the primary key), and its transaction must be retried.

        Raises:
            TargetFenced: the table holds a higher fence for ``key``; nothing was written.
            ValueError: ``fence`` is not an integer >= 0, or ``key`` is empty.
        """
        check_fence(fence)
        if not key:
            raise ValueError("a fence key must not be empty")
        cursor.execute(self._update, (fence, key, fence))
        if cursor.rowcount == 1:
            return
        cursor.execute(self._insert, (key, fence, key))
        if cursor.rowcount == 1:
            return
        highest = self.highest(cursor, key)
        raise TargetFenced(key, fence, -1 if highest is None else highest)

    def highest(self, cursor: FenceCursor, key: str) -> int | None:
        """The highest fence recorded for ``key``, or ``None``."""
        cursor.execute(self._select, (key,))
        row = cursor.fetchone()
        return None if row is None else int(row[0])
