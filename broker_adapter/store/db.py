"""One SQLite connection with the pragmas our guarantees rest on, plus schema migrations.

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
import re
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from broker_adapter import crashpoints
from broker_adapter.errors import ConfigError, StoreBusy, StoreError
from broker_adapter.protocol.envelope import content_fingerprint
from broker_adapter.store.gate import WriteGate

Synchronous = Literal["FULL", "NORMAL", "EXTRA"]
DEFAULT_BUSY_TIMEOUT_MS = 10_000
#: A writer that finds the write lock taken tries again after about this long (jittered),
#: then after 1.5 times as long each time, up to ``LOCK_WAIT_MAX_S``.
LOCK_WAIT_FIRST_S = 0.00005
LOCK_WAIT_MAX_S = 0.0005

log = logging.getLogger("broker_adapter.store")

# Schema, one entry per version. Never edit a released entry: append a new one.
#
# tasks     one row per accepted request; the state machine (see tasks.py).
# inbox     dedupe record: (principal, message_id) -> fingerprint, task_id.
# outbox    replies waiting to be published; exactly one per terminal task.
# receipts  the receiver side: one row per reply id applied, with its content hash.
# meta      named values of this database, made once (the conflict-answer id key).
MIGRATIONS: tuple[str | Callable[[sqlite3.Connection], None], ...] = (
    """
    CREATE TABLE tasks (
        task_id        TEXT PRIMARY KEY,
        principal      TEXT NOT NULL,
        message_id     TEXT NOT NULL,
        kind           TEXT NOT NULL,
        payload        TEXT NOT NULL,
        fingerprint    TEXT NOT NULL,
        correlation_id TEXT,
        parent_id      TEXT,
        state          TEXT NOT NULL CHECK (state IN ('pending', 'running', 'done', 'failed',
                           'cancelled', 'expired', 'hop_limit', 'unknown', 'waiting_approval')),
        attempts       INTEGER NOT NULL DEFAULT 0,
        max_attempts   INTEGER NOT NULL CHECK (max_attempts BETWEEN 1 AND 10),
        fence          INTEGER NOT NULL DEFAULT 0,
        owner          TEXT,
        lease_until    REAL,
        not_before     REAL NOT NULL,
        deadline       REAL NOT NULL,
        hops           INTEGER NOT NULL,
        created_at     REAL NOT NULL,
        updated_at     REAL NOT NULL,
        finished_at    REAL,
        result         TEXT,
        error          TEXT,
        CHECK (attempts <= max_attempts)
    );
    CREATE INDEX tasks_ready ON tasks (not_before) WHERE state = 'pending';
    CREATE INDEX tasks_leases ON tasks (lease_until) WHERE state = 'running';
    CREATE INDEX tasks_state ON tasks (state);
    CREATE INDEX tasks_live_deadline ON tasks (deadline)
        WHERE state IN ('pending', 'running');

    CREATE TABLE inbox (
        principal   TEXT NOT NULL,
        message_id  TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        task_id     TEXT NOT NULL REFERENCES tasks (task_id),
        entry_id    TEXT,
        received_at REAL NOT NULL,
        duplicates  INTEGER NOT NULL DEFAULT 0,
        conflicts   INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (principal, message_id)
    ) WITHOUT ROWID;
    CREATE INDEX inbox_received ON inbox (received_at);

    CREATE TABLE outbox (
        reply_id     TEXT PRIMARY KEY,
        task_id      TEXT REFERENCES tasks (task_id),
        principal    TEXT NOT NULL,
        message_id   TEXT NOT NULL,
        status       TEXT NOT NULL,
        body         BLOB NOT NULL,
        content_hash TEXT NOT NULL,
        state        TEXT NOT NULL CHECK (state IN ('pending', 'sending', 'sent', 'dead')),
        attempts     INTEGER NOT NULL DEFAULT 0,
        fence        INTEGER NOT NULL DEFAULT 0,
        owner        TEXT,
        lease_until  REAL,
        not_before   REAL NOT NULL,
        last_error   TEXT,
        entry_id     TEXT,
        created_at   REAL NOT NULL,
        sent_at      REAL,
        replays      INTEGER NOT NULL DEFAULT 0,
        replayed_by  TEXT,
        replayed_at  REAL
    );
    CREATE UNIQUE INDEX outbox_one_reply_per_task ON outbox (task_id)
        WHERE task_id IS NOT NULL;
    CREATE INDEX outbox_ready ON outbox (not_before) WHERE state = 'pending';
    CREATE INDEX outbox_leases ON outbox (lease_until) WHERE state = 'sending';
    CREATE INDEX outbox_state ON outbox (state);

    CREATE TABLE receipts (
        reply_id     TEXT PRIMARY KEY,
        content_hash TEXT NOT NULL,
        principal    TEXT NOT NULL,
        message_id   TEXT,
        task_id      TEXT,
        status       TEXT,
        body         BLOB NOT NULL,
        entry_id     TEXT,
        received_at  REAL NOT NULL,
        effects      INTEGER NOT NULL DEFAULT 0,
        effect_result TEXT
    );
    """,
    # 2: ``tasks_state`` goes. Every claim and settle moved each task through it twice, and
    # no hot query reads it: the queues have their partial indexes (``tasks_ready``,
    # ``tasks_leases``, ``tasks_live_deadline``) and counting by state scans either way.
    """
    DROP INDEX IF EXISTS tasks_state;
    """,
    # 3: the ``state`` CHECKs of ``tasks`` and ``outbox`` become chains of ``=``. SQLite
    # evaluates an ``IN`` list of three or more constants by building a temporary index,
    # once per row checked: about 2 us on every insert and every state change, inside the
    # write lock. Same rule, same stored data, so only the schema text changes.
    lambda c: _rewrite_in_checks(c, ("tasks", "outbox")),
    # 4: fingerprints write floats the ECMAScript way (``envelope.canonical_numbers``), so
    # that ``13.0`` and a resend's ``13`` are one request. Stored ones are recomputed from
    # the content each task row keeps.
    lambda c: _recompute_fingerprints(c),
    # 5: ``meta`` and its first value, a random key for the ids of conflict answers
    # (``tasks.conflict_reply_id``): made once here, from the OS's random source, it never
    # leaves the database, so nobody who sees the requests can work those ids out.
    lambda c: _create_meta(c),
    # 6: an index of the conflict answers (outbox rows without a task) by age, for the
    # purge (``retention``): the only outbox rows it cannot reach through their task.
    # Partial: the replies of tasks, nearly every row, are not in it and cost it nothing.
    """
    CREATE INDEX IF NOT EXISTS outbox_answers ON outbox (created_at) WHERE task_id IS NULL;
    """,
    # 7: the W3C ``traceparent`` a request was sent in (an optional envelope member), kept
    # with its task so that its reply carries it and the worker's span is parented on it.
    # NULL for every task accepted before and for requests sent without one.
    lambda c: _add_column(c, "tasks", "traceparent", "TEXT"),
)
SCHEMA_VERSION = len(MIGRATIONS)
#: The ``meta`` row holding the key of conflict-answer ids.
CONFLICT_ID_KEY = "conflict_id_key"


def _create_meta(c: sqlite3.Connection) -> None:
    """Migration 5 (idempotent, like every migration: a key once made is never replaced)."""
    c.execute(
        "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value BLOB NOT NULL) WITHOUT ROWID"
    )
    c.execute(
        "INSERT OR IGNORE INTO meta (name, value) VALUES (?, ?)", (CONFLICT_ID_KEY, os.urandom(32))
    )


def _add_column(c: sqlite3.Connection, table: str, column: str, decl: str) -> None:
    """``ALTER TABLE ... ADD COLUMN`` unless the column is there already (idempotent, like
    every migration). Adding a nullable column rewrites no row."""
    if column not in {r[1] for r in c.execute(f"PRAGMA table_info({table})")}:
        c.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")


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
                for number in range(version, SCHEMA_VERSION):
                    migration = MIGRATIONS[number]
                    if callable(migration):
                        migration(self.conn)
                    else:
                        for statement in _split(migration):
                            self.conn.execute(statement)
                    self.conn.execute(f"PRAGMA user_version = {number + 1}")
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

    @contextmanager
    def write(self, op: str, *, foreign_keys: bool = True) -> Iterator[sqlite3.Connection]:
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
    def read(self) -> Iterator[sqlite3.Connection]:
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
                log.warning("database file %s had mode %04o; tightened to %04o",
                            file, mode, mode & ~_SHARED_BITS)  # fmt: skip
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


_IN_CHECK = re.compile(r"CHECK \((\w+) IN \(([^()]*)\)\)")


def _rewrite_in_checks(c: sqlite3.Connection, tables: Sequence[str]) -> None:
    """Rewrite each ``CHECK (col IN ('a', 'b', ...))`` of ``tables`` as
    ``CHECK (col = 'a' OR col = 'b' OR ...)``: the same rule, cheaper to evaluate.

    A CHECK lives only in the schema text, so this is the schema edit SQLite documents for
    changing constraints that do not affect stored data (``PRAGMA writable_schema`` plus a
    ``schema_version`` bump that makes every other connection re-read the schema), inside
    the migration's transaction. A table whose text has no such CHECK is left alone.
    """

    def as_chain(match: re.Match[str]) -> str:
        column, values = match.group(1), [v.strip() for v in match.group(2).split(",")]
        return "CHECK (" + " OR ".join(f"{column} = {v}" for v in values) + ")"

    version = c.execute("PRAGMA schema_version").fetchone()[0]
    c.execute("PRAGMA writable_schema = ON")
    try:
        for table in tables:
            row = c.execute(
                "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
            ).fetchone()
            if row is None:
                raise StoreError(f"migration: table {table!r} is missing")
            sql = _IN_CHECK.sub(as_chain, row[0])
            if sql != row[0]:
                c.execute(
                    "UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = ?",
                    (sql, table),
                )
        c.execute(f"PRAGMA schema_version = {int(version) + 1}")
    finally:
        c.execute("PRAGMA writable_schema = OFF")


def _recompute_fingerprints(c: sqlite3.Connection) -> None:
    """Recompute the fingerprint of every task whose payload may hold a float, and of the
    inbox record that points at it, with ``content_fingerprint``.

    A task row keeps everything its fingerprint covers (``kind``, ``payload`` as canonical
    JSON, ``correlation_id``, ``parent_id``), so every stored fingerprint can be recomputed;
    a payload without a float (no digit followed by ``.``, ``e`` or ``E``: SQLite's GLOB
    leaves those rows out) has the same fingerprint either way. What cannot be recomputed
    is what was sent out: the ``fingerprint`` fields in conflict replies already written
    keep the old form, and a conflicting resend after the migration gets a new conflict
    reply id (its id is derived from the fingerprint), hence one more ``conflict`` reply.
    """
    rows = c.execute(
        "SELECT task_id, kind, payload, correlation_id, parent_id, fingerprint FROM tasks"
        " WHERE payload GLOB '*[0-9][.eE]*'"
    ).fetchall()
    for task_id, kind, payload, correlation_id, parent_id, old in rows:
        new = content_fingerprint(kind, payload.encode("utf-8"), correlation_id, parent_id)
        if new != old:
            c.execute("UPDATE tasks SET fingerprint = ? WHERE task_id = ?", (new, task_id))
            c.execute(
                "UPDATE inbox SET fingerprint = ? WHERE task_id = ? AND fingerprint = ?",
                (new, task_id, old),
            )


#: Values per ``IN (...)`` list in the lookups that take a batch's ids (bound parameters).
IN_LIST_CHUNK = 500


def in_lists(values: Sequence[Any]) -> Iterator[tuple[Sequence[Any], str]]:
    """``values`` in chunks of at most ``IN_LIST_CHUNK``, each with its ``?, ?, ...``
    placeholders, for ``... IN (<placeholders>)`` lookups that stay within SQLite's limit
    on bound parameters."""
    for start in range(0, len(values), IN_LIST_CHUNK):
        chunk = values[start : start + IN_LIST_CHUNK]
        yield chunk, ", ".join("?" * len(chunk))


def _split(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def _translate(exc: sqlite3.OperationalError) -> Exception:
    if _is_busy(exc):
        return StoreBusy(f"database is locked: {exc}")
    return StoreError(str(exc))
