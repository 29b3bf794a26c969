"""One SQL text for both stores: what a store module may assume of the connection it is
given, and the few places where SQLite and PostgreSQL differ.

A store operation is written once, against ``Conn``: ``execute`` with ``?`` placeholders
and rows read by column name. ``Database.write`` (SQLite) and ``PgDatabase.write``
(PostgreSQL) both hand one out, inside the transaction they run. The PostgreSQL connection
turns each ``?`` into the driver's ``%s``, so portable SQL holds no literal ``?`` or ``%``
(pass such text as a parameter).

What differs is named by the connection's ``dialect``:

* ``for_update``: appended to a read whose rows the same transaction then writes. SQLite
  runs one writer at a time (``BEGIN IMMEDIATE``), so a read-then-write cannot race and the
  clause is empty; PostgreSQL's READ COMMITTED lets two transactions read the same row, so
  the read takes the row lock (``FOR UPDATE``) and the second waits for the first.
* ``skip_locked``: the same for a claim that must not wait on rows another transaction is
  taking (``FOR UPDATE SKIP LOCKED``): two workers never take the same row and never queue
  behind each other.
* ``key_lock``: a statement that takes a transaction-scoped lock on one 64-bit key, for
  writers that must serialise on something that is not a row yet (two accepts of one
  request identity on two hosts): PostgreSQL's ``pg_advisory_xact_lock``; SQLite needs
  none (``None``), its one writer is serial already.
* ``indexed_by(index)`` / ``unindexed(column)``: SQLite's planner hints (``INDEXED BY``,
  a unary ``+`` that keeps a column's index out of a plan) on the hot statements whose plan
  must not change with the data; PostgreSQL plans without them (empty, and the bare name).
* ``rowid``: the column that numbers a table's rows oldest first (``tasks``, ``receipts``),
  the cursor of a purge pass: SQLite's ``rowid``, PostgreSQL's ``seq`` identity.
* ``text``: a free-text value (an error, a reason) as the database can hold it: PostgreSQL
  refuses a NUL character in ``text``, which becomes U+FFFD; SQLite keeps it.
* ``server_clock``: whether "now" is the database server's (PostgreSQL, shared by hosts)
  or the process's (SQLite, one host): ``dbclock.tx_now``.

Everything else the two stores share is standard SQL both accept: ``INSERT ... ON CONFLICT
DO NOTHING``, ``RETURNING``, ``SAVEPOINT``, ``coalesce``, ``IN (...)`` lists.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, Protocol


@dataclass(frozen=True)
class Dialect:
    """What one database engine needs said its own way (see the module text)."""

    name: Literal["sqlite", "postgresql"]
    for_update: str
    skip_locked: str
    key_lock: str | None
    nul_free_text: bool
    index_hints: bool
    rowid: str
    #: whether the server keeps the one clock leases are judged by (``dbclock``)
    server_clock: bool = False

    def indexed_by(self, index: str) -> str:
        """`` INDEXED BY <index>`` where the engine takes the hint, else nothing."""
        return f" INDEXED BY {index}" if self.index_hints else ""

    def unindexed(self, column: str) -> str:
        """``column`` as an expression no index serves (``+column``) where that is a hint."""
        return f"+{column}" if self.index_hints else column

    def text(self, value: str | None) -> str | None:
        """``value`` as a free-text column of this engine can hold it."""
        if value is None or not self.nul_free_text or "\x00" not in value:
            return value
        return value.replace("\x00", "\ufffd")


SQLITE: Final = Dialect(
    "sqlite",
    for_update="",
    skip_locked="",
    key_lock=None,
    nul_free_text=False,
    index_hints=True,
    rowid="rowid",
)
POSTGRES: Final = Dialect(
    "postgresql",
    for_update=" FOR UPDATE",
    skip_locked=" FOR UPDATE SKIP LOCKED",
    key_lock="SELECT pg_advisory_xact_lock(?)",
    nul_free_text=True,
    index_hints=False,
    rowid="seq",
    server_clock=True,
)


class Cursor(Protocol):
    """What a store reads from a statement it ran."""

    @property
    def rowcount(self) -> int: ...
    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...


class Conn(Protocol):
    """The connection of one open transaction, whichever engine (see the module text)."""

    dialect: ClassVar[Dialect]

    def execute(self, sql: str, parameters: Sequence[Any] = ..., /) -> Cursor: ...
    def executemany(self, sql: str, parameters: Iterable[Sequence[Any]], /) -> Cursor: ...


#: How long a database of either engine waits for a lock before a write gives up
#: (``StoreBusy``), milliseconds, unless told otherwise.
DEFAULT_BUSY_TIMEOUT_MS: Final = 10_000


class Db(Protocol):
    """A store's database, whichever engine: short transactions handing out a ``Conn``."""

    @property
    def dialect(self) -> Dialect: ...

    def write(self, op: str) -> AbstractContextManager[Conn]: ...
    def read(self) -> AbstractContextManager[Conn]: ...
    def fetch_one(self, sql: str, params: Sequence[Any] = ()) -> Any: ...
    def close(self) -> None: ...


class SqliteConnection(sqlite3.Connection):
    """``sqlite3.Connection`` that says its dialect (``Database`` opens its file with it)."""

    dialect: ClassVar[Dialect] = SQLITE


@functools.lru_cache(maxsize=1024)
def pg_sql(sql: str) -> str:
    """Portable SQL in the PostgreSQL driver's placeholder style (``?`` becomes ``%s``)."""
    return sql.replace("?", "%s")


def marks(n: int) -> str:
    """``n`` placeholders for an ``IN (...)`` list or a VALUES row: ``?, ?, ?``."""
    return ", ".join("?" * n)


#: Values per ``IN (...)`` list in the lookups that take a batch's ids (bound parameters).
IN_LIST_CHUNK: Final = 500


def in_lists(values: Sequence[Any]) -> Iterator[tuple[Sequence[Any], str]]:
    """``values`` in chunks of at most ``IN_LIST_CHUNK``, each with its ``marks``, for
    ``... IN (<placeholders>)`` lookups that stay within SQLite's limit on bound
    parameters."""
    for start in range(0, len(values), IN_LIST_CHUNK):
        chunk = values[start : start + IN_LIST_CHUNK]
        yield chunk, marks(len(chunk))
