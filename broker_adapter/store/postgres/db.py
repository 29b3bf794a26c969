"""A pool of PostgreSQL connections, and the short transactions every store operation runs.

``PgDatabase`` is the PostgreSQL counterpart of ``store.db.Database``: ``write(op)`` runs
one transaction (``BEGIN`` ... ``COMMIT`` on a pooled connection) with the crash points
``store.<op>.before_commit`` and ``store.<op>.after_commit`` on both sides of the COMMIT,
the same names as SQLite's; ``read()`` runs a read-only one; ``fetch_one`` one statement
on its own. A transaction holds only SQL: what it writes is computed before it, and no
handler, network or Redis call runs inside it (``docs/RULES.md``).

Isolation is PostgreSQL's default, READ COMMITTED: each statement sees what was committed
before it began, and every write that must not race another takes its rows' locks in the
statement that checks them (``FOR UPDATE SKIP LOCKED`` for claims, the fence and lease
checks in the WHERE clause of the fenced UPDATE: see ``tasks`` and ``outbox``). Several
processes on several hosts share one database this way, with no ``WriteGate``: the server
arbitrates row by row, not one writer at a time.

Errors: a lost connection, a lock timeout, a deadlock or a serialization failure is
``StoreBusy`` (transient: the caller tries again, nothing was committed); anything else
``StoreError``. A pool belongs to the process that made it: after ``fork()`` it is refused.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ClassVar, Final

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from broker_adapter import crashpoints
from broker_adapter.errors import ConfigError, StoreBusy, StoreError
from broker_adapter.store.postgres.schema import (
    SCHEMA_VERSION,
    SchemaTooNew,
    current_version,
    migrate,
)
from broker_adapter.store.sql import DEFAULT_BUSY_TIMEOUT_MS, POSTGRES, Dialect, pg_sql
from broker_adapter.store.urls import is_postgres_url, redacted_url

log = logging.getLogger("broker_adapter.store")

#: Connections one ``PgDatabase`` opens at most. Each stage thread (ingest, dispatcher,
#: purger, a worker process) opens its own ``PgDatabase`` and runs one transaction at a
#: time, a worker's lease renewals beside it: 3 leaves a spare. An adapter with N workers
#: holds about N + 3 connections, well within a server's default of 100 for a few hosts.
DEFAULT_POOL_MAX: Final = 3
#: How long a statement waits for a row lock, and a caller for a pooled connection, before
#: ``StoreBusy``: the SQLite store's busy timeout.
#: Session settings of every pooled connection.
_SESSION = (
    "SET lock_timeout = {busy}; SET idle_in_transaction_session_timeout = 60000;"
    " SET application_name = 'broker_adapter'"
)

Row = dict[str, Any]
RawConn = psycopg.Connection[Row]


class PgConn:
    """A pooled connection inside one transaction, as the store modules use it: portable
    SQL (``store.sql``: ``?`` placeholders) through ``execute``/``executemany``, and the
    driver's own connection as ``raw`` for what only PostgreSQL says (arrays, advisory
    locks)."""

    dialect: ClassVar[Dialect] = POSTGRES
    __slots__ = ("raw",)

    def __init__(self, raw: RawConn) -> None:
        self.raw = raw

    def execute(self, sql: str, parameters: Sequence[Any] = (), /) -> psycopg.Cursor[Row]:
        return self.raw.execute(pg_sql(sql), parameters)

    def executemany(self, sql: str, parameters: Iterable[Sequence[Any]], /) -> psycopg.Cursor[Row]:
        cur = self.raw.cursor()
        cur.executemany(pg_sql(sql), parameters)
        return cur

    def cursor(self) -> psycopg.Cursor[Row]:
        return self.raw.cursor()

    def transaction(self) -> AbstractContextManager[Any]:
        """A SAVEPOINT inside the open transaction (psycopg's nested ``transaction()``)."""
        return self.raw.transaction()


#: Server errors that mean "nothing was committed, try again".
_TRANSIENT = (
    pg_errors.LockNotAvailable,
    pg_errors.DeadlockDetected,
    pg_errors.SerializationFailure,
    pg_errors.QueryCanceled,
    pg_errors.AdminShutdown,
    pg_errors.CannotConnectNow,
)


class PgDatabase:
    """A connection pool on one PostgreSQL database, migrated on open.

    Args:
        url: a libpq URL (``postgresql://user@host:port/dbname?...``).
        pool_max: connections this process opens at most.
        busy_timeout_ms: how long a row lock or a free connection is waited for before
            ``StoreBusy``.
        read_only: for commands that only look: no migration (the schema must be current,
            ``StoreError`` otherwise) and ``write`` is refused.

    Raises:
        ConfigError: ``url`` is not a PostgreSQL URL.
        StoreBusy: the server is unreachable (it may come back).
        StoreError: the database holds a newer schema, or is not usable.
    """

    def __init__(
        self,
        url: str,
        *,
        pool_max: int = DEFAULT_POOL_MAX,
        busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
        read_only: bool = False,
    ) -> None:
        if not is_postgres_url(url):
            raise ConfigError(f"not a PostgreSQL URL: {url!r}")
        self.url = url
        self.path = redacted_url(url)  # what messages and logs show (``Database.path``)
        self.read_only = read_only
        self._pid = os.getpid()
        self._busy_s = busy_timeout_ms / 1000
        session = _SESSION.format(busy=int(busy_timeout_ms))

        def configure(conn: psycopg.Connection[Any]) -> None:
            conn.execute(session)
            conn.commit()

        self.pool: ConnectionPool[RawConn] = ConnectionPool(
            url,
            min_size=1,
            max_size=max(1, pool_max),
            kwargs={"row_factory": dict_row, "connect_timeout": 10},
            configure=configure,
            open=False,
            name="broker_adapter",
            num_workers=1,  # the pool's own threads (connecting, growing): one is plenty
        )
        try:
            self.pool.open(wait=True, timeout=self._busy_s)
        except PoolTimeout as exc:
            self.pool.close()
            raise StoreBusy(f"cannot connect to {self.path}: {exc}") from exc
        try:
            self._check_schema()
        except BaseException:
            self.pool.close()
            raise

    def _check_schema(self) -> None:
        try:
            with self._connection() as conn:
                if self.read_only:
                    version = current_version(conn)
                    conn.rollback()
                    if version != SCHEMA_VERSION:
                        raise StoreError(self._schema_refusal(version))
                    return
                migrate(conn)
        except SchemaTooNew as exc:
            raise StoreError(self._schema_refusal(exc.version)) from exc

    def _schema_refusal(self, version: int) -> str:
        if version > SCHEMA_VERSION:
            return (
                f"{self.path} has schema version {version}, this library knows "
                f"{SCHEMA_VERSION}: upgrade broker_adapter"
            )
        if version == 0:
            return f"{self.path} is not a broker_adapter database"
        return (
            f"{self.path} has schema version {version}, this library knows {SCHEMA_VERSION}:"
            " a command that writes it (run, receive) migrates it"
        )

    @property
    def dialect(self) -> Dialect:
        """PostgreSQL's (``store.sql``)."""
        return POSTGRES

    @contextmanager
    def _connection(self) -> Iterator[RawConn]:
        """A pooled connection, errors translated (``StoreBusy`` / ``StoreError``)."""
        if os.getpid() != self._pid:
            raise StoreError("a PostgreSQL pool was used after fork(); open a new one in the child")
        try:
            with self.pool.connection(timeout=self._busy_s) as conn:
                yield conn
        except PoolTimeout as exc:
            raise StoreBusy(f"no free connection to {self.path}: {exc}") from exc
        except psycopg.Error as exc:
            raise translate_pg_error(exc, self.path) from exc

    @contextmanager
    def write(self, op: str) -> Iterator[PgConn]:
        """Run one write transaction; crash points ``store.<op>.before_commit`` and
        ``store.<op>.after_commit`` fire around its COMMIT.

        Raises:
            StoreBusy: a lock, a connection or the server was not to be had in time, or
                the server aborted the transaction to resolve a conflict; nothing written.
            StoreError: the database refused the transaction.
        """
        if self.read_only:
            raise StoreError(f"{self.path} was opened read-only: no {op}")
        # psycopg's transaction block: BEGIN now, COMMIT at its end, ROLLBACK on an
        # exception; a ``conn.transaction()`` inside it is a SAVEPOINT.
        with self._connection() as conn, conn.transaction():
            yield PgConn(conn)
            crashpoints.hit(f"store.{op}.before_commit")
        crashpoints.hit(f"store.{op}.after_commit")

    @contextmanager
    def read(self) -> Iterator[PgConn]:
        """A read-only transaction (each statement sees what was committed before it)."""
        with self._connection() as conn:
            try:
                conn.execute("SET TRANSACTION READ ONLY")
                yield PgConn(conn)
            finally:
                if not conn.closed:
                    conn.rollback()

    def fetch_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        """The first row of ONE read statement, on its own."""
        with self._connection() as conn:
            row = conn.execute(pg_sql(sql), params).fetchone()
            conn.rollback()
        return row

    def meta(self, name: str) -> bytes:
        """A value of the ``meta`` table.

        Raises:
            StoreError: there is no such value.
        """
        row = self.fetch_one("SELECT value FROM meta WHERE name = %s", (name,))
        if row is None:
            raise StoreError(f"{self.path}: no meta value {name!r}")
        return bytes(row["value"])

    def close(self) -> None:
        if os.getpid() == self._pid:
            self.pool.close()

    def __enter__(self) -> PgDatabase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def probe_postgres(url: str, timeout_s: float) -> str | None:
    """Why ``url``'s database cannot be written now, or None (a readiness check: one
    short connection, ``SELECT pg_is_in_recovery()``, nothing written)."""
    try:
        with psycopg.connect(url, connect_timeout=max(1, round(timeout_s))) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
    except psycopg.Error as exc:
        return f"database: {redacted_url(url)}: {str(exc).strip().splitlines()[0]}"
    if row is not None and row[0]:
        return f"database: {redacted_url(url)} is a standby in recovery (read-only)"
    return None


def translate_pg_error(exc: psycopg.Error, where: str) -> Exception:
    """The library's error for a driver error: ``StoreBusy`` when nothing was committed and
    trying again may succeed (a lost connection, a lock or deadlock timeout), else
    ``StoreError``."""
    if isinstance(exc, (*_TRANSIENT, psycopg.OperationalError)):
        return StoreBusy(f"{where}: {exc}")
    return StoreError(f"{where}: {exc}")
