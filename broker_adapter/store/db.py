"""One SQLite connection with the pragmas our guarantees rest on; it migrates the schema
(``migrations``) when it opens a database.

Every write is one short ``BEGIN IMMEDIATE`` transaction opened by ``Database.write``. An
immediate transaction takes the write lock up front, so it waits out ``busy_timeout``
instead of failing at its first write the way a deferred one does. Writers of one file in
one process take turns on a Python lock; the processes of one pool (the runner and its
workers) then queue on a shared ``WriteGate``; a lock still busy after that (a writer from
outside the pool) is retried every 0.05 to 0.5 ms (jittered) rather than by SQLite's busy
handler, whose 1 to 100 ms sleeps turned brief contention into long idle waits. Crash points
``store.<op>.before_commit`` and ``store.<op>.after_commit`` sit on both sides of every
COMMIT: a process killed before it leaves no trace (SQLite rolls the journal back on the
next open), a process killed after it leaves the whole transaction durable
(``synchronous=FULL`` syncs the WAL at every commit).

A connection belongs to the process that opened it: using it after ``fork()`` corrupts
SQLite's locking, so ``Database`` refuses to.
"""

from __future__ import annotations

import logging
import os
import random
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from broker_adapter import crashpoints
from broker_adapter.errors import ConfigError, StoreBusy, StoreError
from broker_adapter.store.gate import WriteGate
from broker_adapter.store.migrations import SCHEMA_VERSION, apply_migrations
from broker_adapter.store.sql import DEFAULT_BUSY_TIMEOUT_MS, SQLITE, Dialect, SqliteConnection

Synchronous = Literal["FULL", "NORMAL", "EXTRA"]
#: A writer that finds the write lock taken tries again after about this long (jittered),
#: then after 1.5 times as long each time, up to ``LOCK_WAIT_MAX_S``.
LOCK_WAIT_FIRST_S = 0.00005
LOCK_WAIT_MAX_S = 0.0005

log = logging.getLogger("broker_adapter.store")


class Database:
    """A SQLite connection configured for durability, owned by one process.

    Args:
        path: the database file (created if absent, with mode 0600; an existing one with
            permissions for its group or others is tightened to 0600, see
            ``_private_file``).
        synchronous: ``FULL`` (default) syncs the WAL at every commit; ``NORMAL`` may lose
            the last commits on power loss (never on a process crash).
        busy_timeout_ms: how long a writer waits for the lock before ``StoreBusy``.
        gate: the ``WriteGate`` the writers of this file in the processes of one pool
            share (``WorkerPool`` makes it): writers wait their turn on it instead of
            polling SQLite's lock. ``None``: poll only.
        read_only: for commands that only look (``status``, ``receipts``): the file must
            exist already (``ConfigError`` otherwise, and it is never created) and hold the
            current schema; it is opened ``mode=ro`` (no migration, no mode change, no
            journal or sync settings) and ``write`` is refused.

    Raises:
        ConfigError: ``read_only`` and there is no file at ``path``, or its directory
            does not exist.
        StoreError: the file is not a usable database (for ``read_only``: not at the
            current schema either).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: Synchronous = "FULL",
        busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
        gate: WriteGate | None = None,
        read_only: bool = False,
    ) -> None:
        if str(path).startswith(("postgresql:", "postgres:")):
            raise ConfigError(
                f"{path}: this needs a SQLite file; a PostgreSQL database is backed up and"
                " inspected with the server's own tools (pg_dump, psql)"
            )
        if synchronous not in ("FULL", "NORMAL", "EXTRA"):
            raise ConfigError(f"synchronous must be FULL, NORMAL or EXTRA, got {synchronous!r}")
        self.path = Path(path)
        self.read_only = read_only
        self._busy_timeout_ms = int(busy_timeout_ms)
        self._pid = os.getpid()
        self._writers = _writers_of(self.path)
        self._gate = gate
        self._lock = threading.RLock()
        if read_only:
            if not self.path.is_file():
                raise ConfigError(f"no database at {self.path}")
            target = self.path.resolve().as_uri() + "?mode=ro"  # SQLite never creates it
        else:
            if not self.path.parent.is_dir():
                raise ConfigError(f"no directory {self.path.parent} for the database {self.path}")
            _private_file(self.path)
            target = str(self.path)
        try:
            self.conn = sqlite3.connect(
                target,
                isolation_level=None,
                timeout=busy_timeout_ms / 1000,
                check_same_thread=False,
                uri=read_only,
                factory=SqliteConnection,
            )
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open database {self.path}: {exc}") from exc
        self.conn.row_factory = sqlite3.Row
        try:
            self._configure(synchronous, busy_timeout_ms)
            self._migrate()
        except sqlite3.OperationalError as exc:
            self.conn.close()
            if _is_busy(exc):  # another writer held the lock past the busy timeout
                raise StoreBusy(f"cannot open database {self.path}: {exc}") from exc
            raise StoreError(f"cannot use database {self.path}: {exc}") from exc
        except sqlite3.DatabaseError as exc:
            self.conn.close()
            raise StoreError(f"cannot use database {self.path}: {exc}") from exc
        except BaseException:
            # e.g. the StoreError for a newer schema or a refused pragma: do not leak the
            # connection (and its file descriptors) of a Database that was never returned.
            self.conn.close()
            raise

    def _configure(self, synchronous: str, busy_timeout_ms: int) -> None:
        c = self.conn
        c.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        if self.read_only:  # a reader changes neither the journal nor the file's syncs
            c.execute("PRAGMA query_only = ON")
            return
        mode = c.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StoreError(f"{self.path}: journal_mode is {mode}, WAL is required")
        c.execute(f"PRAGMA synchronous = {synchronous}")
        c.execute("PRAGMA foreign_keys = ON")
        expected = {"FULL": 2, "NORMAL": 1, "EXTRA": 3}[synchronous]
        got = c.execute("PRAGMA synchronous").fetchone()[0]
        if got != expected:
            raise StoreError(f"{self.path}: synchronous is {got}, expected {expected}")

    def _migrate(self) -> None:
        # A current schema needs no write lock: opening a database must not queue behind
        # (or fail on) a writer that holds the lock, as every process of a pool opens its own.
        version = self.conn.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if self.read_only:
            raise StoreError(self._schema_refusal(version))
        with self._lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                version = self.conn.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise StoreError(self._schema_refusal(version))
                apply_migrations(self.conn, version)
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise

    def _schema_refusal(self, version: int) -> str:
        """Why a database at schema ``version`` cannot be used as it is."""
        if version > SCHEMA_VERSION:
            return (
                f"{self.path} has schema version {version}, this library knows "
                f"{SCHEMA_VERSION}: upgrade broker_adapter"
            )
        if version == 0:  # read-only: an empty file, or another program's database
            return f"{self.path} is not a broker_adapter database"
        return (
            f"{self.path} has schema version {version}, this library knows {SCHEMA_VERSION}:"
            " a command that writes it (run, receive) migrates it"
        )

    def _check_owner(self) -> None:
        if os.getpid() != self._pid:
            raise StoreError(
                "a SQLite connection was used after fork(); open a new Database in the child"
            )

    def _begin_immediate(self, deadline: float) -> None:
        """``BEGIN IMMEDIATE``, waiting for a busy write lock in short jittered steps.

        SQLite's own busy handler sleeps 1, 2, 5, 10, 15, 20, 25, ... 100 ms between tries:
        with a few writers (ingest, workers, dispatcher) taking turns on sub-millisecond
        transactions, that turns brief contention into tens of milliseconds of idle wait.
        Here each try is made with ``busy_timeout = 0`` and the pause between tries grows
        from ``LOCK_WAIT_FIRST_S`` to ``LOCK_WAIT_MAX_S``; the overall limit is still
        ``busy_timeout_ms``, after which the "database is locked" error propagates.
        """
        c = self.conn
        pause = LOCK_WAIT_FIRST_S
        c.execute("PRAGMA busy_timeout = 0")
        try:
            while True:
                try:
                    c.execute("BEGIN IMMEDIATE")
                    return
                except sqlite3.OperationalError as exc:
                    if not _is_busy(exc) or time.monotonic() >= deadline:
                        raise
                time.sleep(pause * (0.5 + random.random()))  # jitter: writers do not align
                pause = min(pause * 1.5, LOCK_WAIT_MAX_S)
        finally:
            c.execute(f"PRAGMA busy_timeout = {self._busy_timeout_ms}")

    @property
    def dialect(self) -> Dialect:
        """SQLite's (``store.sql``)."""
        return SQLITE

    @contextmanager
    def write(self, op: str, *, foreign_keys: bool = True) -> Iterator[SqliteConnection]:
        """Run one write transaction (``BEGIN IMMEDIATE`` ... ``COMMIT``).

        Args:
            op: the operation's name; crash points ``store.<op>.before_commit`` and
                ``store.<op>.after_commit`` fire around the COMMIT.
            foreign_keys: ``False`` turns the foreign-key checks off for this transaction
                (back on after it): for a writer that deletes children before their parent
                itself, since the check of a deleted parent scans each child table that
                has no index on its key (``inbox.task_id`` has none, on purpose).

        Raises:
            StoreBusy: the write lock was not free within the busy timeout.
            StoreError: the database failed (disk full, I/O error, corruption).
        """
        self._check_owner()
        if self.read_only:
            raise StoreError(f"{self.path} was opened read-only: no {op}")
        # Writers of this file in this process queue on a Python lock first: a thread is
        # handed the turn the moment the previous one commits, instead of polling SQLite.
        deadline = time.monotonic() + self._busy_timeout_ms / 1000
        writers = self._writers
        if not writers.acquire(timeout=self._busy_timeout_ms / 1000):
            raise StoreBusy(f"database is locked: another thread of this process held {op}")
        gate = self._gate
        try:
            # Then, across the processes of a pool, on the gate (see ``WriteGate``); not
            # taking it by the deadline leaves SQLite's lock to decide, as without one.
            if gate is not None:
                gate.enter(deadline)
            with self._lock:
                if not foreign_keys:
                    self.conn.execute("PRAGMA foreign_keys = OFF")  # before BEGIN: ignored inside
                try:
                    self._begin_immediate(deadline)
                    yield self.conn
                    crashpoints.hit(f"store.{op}.before_commit")
                    self.conn.execute("COMMIT")
                except BaseException as exc:
                    if self.conn.in_transaction:
                        self.conn.execute("ROLLBACK")
                    if isinstance(exc, sqlite3.OperationalError):
                        raise _translate(exc) from exc
                    raise
                finally:
                    if not foreign_keys:
                        self.conn.execute("PRAGMA foreign_keys = ON")
        finally:
            if gate is not None:
                gate.leave()  # only if this process holds it (no other thread can)
            writers.release()
        crashpoints.hit(f"store.{op}.after_commit")

    @contextmanager
    def read(self) -> Iterator[SqliteConnection]:
        """A consistent read snapshot (a deferred transaction that never writes)."""
        self._check_owner()
        with self._lock:
            self.conn.execute("BEGIN")
            try:
                yield self.conn
            finally:
                self.conn.execute("COMMIT")

    def fetch_one(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Row | None:
        """The first row of ONE read statement, run as its own (autocommit) transaction:
        no ``BEGIN``/``COMMIT`` round around it, for lookups that need no snapshot across
        statements (a worker asks one per task)."""
        self._check_owner()
        with self._lock:
            row: sqlite3.Row | None = self.conn.execute(sql, params).fetchone()
        return row

    def meta(self, name: str) -> bytes:
        """A value of the ``meta`` table (e.g. ``CONFLICT_ID_KEY``).

        Raises:
            StoreError: there is no such value.
        """
        row = self.fetch_one("SELECT value FROM meta WHERE name = ?", (name,))
        if row is None:
            raise StoreError(f"{self.path}: no meta value {name!r}")
        return bytes(row[0])

    def integrity_check(self) -> str:
        with self._lock:
            return str(self.conn.execute("PRAGMA integrity_check").fetchone()[0])

    def close(self) -> None:
        if os.getpid() == self._pid:
            self.conn.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_database(path: str | Path, **kwargs: object) -> Database:
    """Open (and migrate) the database at ``path``; see ``Database`` for the arguments."""
    return Database(path, **kwargs)  # type: ignore[arg-type]


#: Permission bits a database file (and its ``-wal``/``-shm``) must not have: the inbox holds
#: every payload, and a writer of the file could forge tasks and replies.
_SHARED_BITS = 0o077


def _private_file(path: Path) -> None:
    """Make sure ``path`` exists with no permissions for group or others, before SQLite
    opens it: SQLite creates ``-wal`` and ``-shm`` with the mode of the main file, so the
    one file decides for all three.

    A new file is created with mode 0600 (an exclusive create: never a race with another
    creator's mode). An existing file, ``-wal`` or ``-shm`` with group or other bits is
    tightened to owner only, keeping its owner bits, with a warning in the log; one that
    cannot be changed (another user's) is left as it is, with a warning, for SQLite to
    open or refuse. ``:memory:`` and the empty path (temporary databases) are left alone.
    """
    name = str(path)
    if name in ("", ":memory:"):
        return
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    except OSError:
        return  # e.g. a missing directory: SQLite reports it, with its own message
    else:
        os.close(fd)
        return
    for file in (name, name + "-wal", name + "-shm"):
        try:
            mode = stat.S_IMODE(os.stat(file).st_mode)
            if mode & _SHARED_BITS:
                os.chmod(file, mode & ~_SHARED_BITS)
                log.warning(
                    "database file %s had mode %04o; tightened to %04o",
                    file,
                    mode,
                    mode & ~_SHARED_BITS,
                )
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("database file %s: cannot tighten its mode (%s)", file, exc)


_WRITERS: dict[tuple[int, str], threading.Lock] = {}
_WRITERS_GUARD = threading.Lock()


def _writers_of(path: Path) -> threading.Lock:
    """The lock this process's writers of ``path`` take in turn (keyed by pid as well: a
    forked child must not inherit a lock held at the fork)."""
    key = (os.getpid(), str(path.resolve()))
    with _WRITERS_GUARD:
        lock = _WRITERS.get(key)
        if lock is None:
            lock = _WRITERS[key] = threading.Lock()
        return lock


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def _translate(exc: sqlite3.OperationalError) -> Exception:
    if _is_busy(exc):
        return StoreBusy(f"database is locked: {exc}")
    return StoreError(str(exc))
