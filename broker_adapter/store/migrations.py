"""The schema, one migration per version, and how a database is brought up to date.

``Database`` opens a file and, inside one ``BEGIN IMMEDIATE`` transaction, applies every
migration past the file's ``PRAGMA user_version`` (``apply_migrations``). A migration is SQL
text or a function of the connection; each is idempotent, and a released one is never
edited: a change is a new entry.
"""

from __future__ import annotations

import os
import re
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any

from broker_adapter.errors import StoreError
from broker_adapter.protocol.envelope import content_fingerprint
from broker_adapter.store import outcome_schema
from broker_adapter.store.identity import STORE_ID_KEY, new_store_id

# Schema, one entry per version. Never edit a released entry: append a new one.
#
# tasks     one row per accepted request; the state machine (see lifecycle.py, tasks.py).
# inbox     dedupe record: (principal, message_id) -> fingerprint, task_id.
# outbox    replies waiting to be published; exactly one per terminal task.
# receipts  the receiver side: one row per reply id applied, with its content hash.
# meta      named values of this database, made once (the conflict-answer id key, the
#           store's identity).
# approvals, approval_waits, approval_releases, reconcile_log, compensations: effects
#           beyond our transaction (effects.py, approvals.py).
# chains    tasks stored per correlation_id, for the chain budget (inbox.py).
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
    # 4: fingerprints write floats the ECMAScript way (``canonical.canonical_numbers``), so
    # that ``13.0`` and a resend's ``13`` are one request. Stored ones are recomputed from
    # the content each task row keeps.
    lambda c: _recompute_fingerprints(c),
    # 5: ``meta`` and its first value, a random key for the ids of conflict answers
    # (``inbox.conflict_reply_id``): made once here, from the OS's random source, it never
    # leaves the database, so nobody who sees the requests can work those ids out.
    lambda c: _create_meta(c),
    # 6: an index of the conflict answers (outbox rows without a task) by age, for the
    # purge (``retention``): the only outbox rows it cannot reach through their task.
    # Partial: the replies of tasks, nearly every row, are not in it and cost it nothing.
    """
    CREATE INDEX IF NOT EXISTS outbox_answers ON outbox (created_at) WHERE task_id IS NULL;
    """,
    # 7: effects beyond our transaction (``effects.py``): on ``tasks``, the cancel request
    # of a running task, the mark of an attempt whose external effect started (its fence
    # and when), the reconcile tries of an ``unknown`` task and since when it waits for an
    # operator; the queue of ``unknown`` tasks; approvals, the tasks waiting for one, the
    # audit of reconciles and the compensation records.
    lambda c: _add_effects_schema(c),
    # 8: the W3C ``traceparent`` a request was sent in (an optional envelope member), kept
    # with its task so that its reply carries it and the worker's span is parented on it.
    # NULL for every task accepted before and for requests sent without one.
    lambda c: _add_column(c, "tasks", "traceparent", "TEXT"),
    # 9: the chain budget (``inbox``): per ``correlation_id``, how many tasks were stored
    # naming it, whoever sent them and whatever ``parent_id`` they gave; forgotten with the
    # retention window after its last task (``retention``).
    """
    CREATE TABLE IF NOT EXISTS chains (
        chain_id   TEXT PRIMARY KEY,
        tasks      INTEGER NOT NULL,
        updated_at REAL NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX IF NOT EXISTS chains_updated ON chains (updated_at);
    """,
    # 10: which approval released a waiting task, and when (``approvals.release_waits``):
    # the wait row goes when the task is released, this one says who approved it.
    """
    CREATE TABLE IF NOT EXISTS approval_releases (
        task_id     TEXT NOT NULL,
        approval_id TEXT NOT NULL,
        released_at REAL NOT NULL,
        PRIMARY KEY (task_id, approval_id)
    ) WITHOUT ROWID;
    """,
    # 11: the task name a request asked for (the optional envelope member ``task``), kept
    # with its task so the worker routes it (``Router``). NULL for every task accepted
    # before and for requests sent without one (the default handler's); the fingerprints
    # of those are unchanged, so no stored row is recomputed.
    lambda c: _add_column(c, "tasks", "task_name", "TEXT"),
    # 12: bounded uncertain outcomes (``outcome_schema``): the ``counters`` the purge never
    # touches, when an operator wait passed its bound, and the evidence columns (the effect
    # key's digest, the adapter version) of tasks, reconcile records and compensations.
    lambda c: outcome_schema.sqlite_migration(c),
    # 13: a request's terms (``deadline``, ``max_attempts``) join its fingerprint, so a
    # resend that changes them is a conflict (every stored fingerprint is recomputed); an
    # approval is bound to the requesting principal and the digest of the effect's
    # arguments and version, and counts its uses (``approvals``).
    lambda c: _bind_terms_and_approvals(c),
    # 14: the store's identity (``identity``), a random id made once: what binds a Redis
    # prefix to this store, kept by a backup, new in a new database.
    lambda c: _create_store_id(c),
    # 15: the key id a request's signature verified with (signed mode; NULL in ACL mode and
    # for every task accepted before): its reply is signed with the same key, so that a
    # receiver that has not yet got a newly added key can still verify it.
    lambda c: _add_column(c, "tasks", "request_kid", "TEXT"),
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


def _create_store_id(c: sqlite3.Connection) -> None:
    """Migration 10 (idempotent: an identity once made is never replaced)."""
    c.execute(
        "INSERT OR IGNORE INTO meta (name, value) VALUES (?, ?)", (STORE_ID_KEY, new_store_id())
    )


def apply_migrations(c: sqlite3.Connection, version: int) -> None:
    """Apply the migrations after ``version`` in the caller's transaction, each followed by
    its ``PRAGMA user_version``."""
    for number in range(version, SCHEMA_VERSION):
        migration = MIGRATIONS[number]
        if callable(migration):
            migration(c)
        else:
            for statement in _split(migration):
                c.execute(statement)
        c.execute(f"PRAGMA user_version = {number + 1}")


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


def _recompute_fingerprints(c: sqlite3.Connection, *, every: bool = False) -> None:
    """Recompute the fingerprint of every task whose payload may hold a float (with
    ``every``: of every task), and of the inbox record that points at it, with
    ``content_fingerprint``.

    A task row keeps everything its fingerprint covers (``kind``, ``payload`` as canonical
    JSON, ``correlation_id``, ``parent_id``, ``deadline``, ``max_attempts``), so every
    stored fingerprint can be recomputed; a payload without a float (no digit followed by
    ``.``, ``e`` or ``E``: SQLite's GLOB leaves those rows out) has the same fingerprint
    either way. What cannot be recomputed is what was sent out: the ``fingerprint`` fields
    in conflict replies already written keep the old form, and a conflicting resend after
    the migration gets a new conflict reply id (its id is derived from the fingerprint),
    hence one more ``conflict`` reply.
    """
    columns = {row[1] for row in c.execute("PRAGMA table_info(tasks)")}
    task = "task_name" if "task_name" in columns else "NULL"  # before migration 11: none
    rows = c.execute(
        "SELECT task_id, kind, payload, correlation_id, parent_id, deadline, max_attempts,"
        f" fingerprint, {task} FROM tasks" + ("" if every else " WHERE payload GLOB '*[0-9][.eE]*'")
    ).fetchall()
    for task_id, new, old in recomputed_fingerprints(rows):
        c.execute("UPDATE tasks SET fingerprint = ? WHERE task_id = ?", (new, task_id))
        c.execute(
            "UPDATE inbox SET fingerprint = ? WHERE task_id = ? AND fingerprint = ?",
            (new, task_id, old),
        )


def recomputed_fingerprints(rows: Sequence[Sequence[Any]]) -> list[tuple[str, str, str]]:
    """``(task_id, new, old)`` for each task row ``(task_id, kind, payload, correlation_id,
    parent_id, deadline, max_attempts, fingerprint, task_name)`` whose fingerprint by
    ``content_fingerprint`` is not the one stored (both stores' migrations use it)."""
    out = []
    for task_id, kind, payload, correlation_id, parent_id, deadline, attempts, old, task in rows:
        new = content_fingerprint(
            kind,
            payload.encode("utf-8"),
            correlation_id,
            parent_id,
            deadline=deadline,
            max_attempts=attempts,
            task=task,
        )
        if new != old:
            out.append((task_id, new, old))
    return out


#: Migration 10's columns: ``(table, name, declaration)``.
BOUND_APPROVAL_COLUMNS = (
    ("approvals", "principal", "TEXT"),
    ("approvals", "arguments_digest", "TEXT"),
    ("approvals", "uses", "INTEGER NOT NULL DEFAULT 1"),
    ("approvals", "used", "INTEGER NOT NULL DEFAULT 0"),
    ("approval_waits", "principal", "TEXT"),
    ("approval_waits", "arguments_digest", "TEXT"),
    ("approval_waits", "arguments", "TEXT"),
    ("tasks", "approval_id", "TEXT"),
)


def _bind_terms_and_approvals(c: sqlite3.Connection) -> None:
    """Migration 10 (idempotent). An approval granted before has no principal or digest:
    it matches no task (grant it again, bound)."""
    _recompute_fingerprints(c, every=True)
    for table, name, declaration in BOUND_APPROVAL_COLUMNS:
        _add_column(c, table, name, declaration)


def _split(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]


#: Migration 7's columns of ``tasks`` (name, declaration).
_EFFECT_COLUMNS = (
    ("cancel_requested_at", "REAL"),
    ("effect_fence", "INTEGER"),
    ("effect_started_at", "REAL"),
    ("reconcile_tries", "INTEGER NOT NULL DEFAULT 0"),
    ("operator_since", "REAL"),
)
_EFFECT_TABLES = """
    CREATE INDEX IF NOT EXISTS tasks_unknown ON tasks (not_before) WHERE state = 'unknown';
    CREATE TABLE IF NOT EXISTS approvals (
        approval_id TEXT PRIMARY KEY,
        action      TEXT NOT NULL,
        target      TEXT NOT NULL,
        scope       TEXT NOT NULL,
        approver    TEXT NOT NULL,
        granted_at  REAL NOT NULL,
        expires_at  REAL NOT NULL,
        revoked_at  REAL,
        revoked_by  TEXT,
        CHECK (expires_at > granted_at)
    );
    CREATE INDEX IF NOT EXISTS approvals_match ON approvals (action, target, scope, expires_at);
    CREATE TABLE IF NOT EXISTS approval_waits (
        task_id TEXT PRIMARY KEY,
        action  TEXT NOT NULL,
        target  TEXT NOT NULL,
        scope   TEXT NOT NULL,
        since   REAL NOT NULL,
        until   REAL NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX IF NOT EXISTS approval_waits_until ON approval_waits (until);
    CREATE TABLE IF NOT EXISTS reconcile_log (
        task_id  TEXT NOT NULL,
        outcome  TEXT NOT NULL CHECK (outcome = 'done' OR outcome = 'not-done'
                     OR outcome = 'unknown'),
        by_whom  TEXT NOT NULL,
        at       REAL NOT NULL,
        fence    INTEGER NOT NULL,
        observed TEXT,
        note     TEXT
    );
    CREATE INDEX IF NOT EXISTS reconcile_log_task ON reconcile_log (task_id, at);
    CREATE TABLE IF NOT EXISTS compensations (
        task_id    TEXT NOT NULL,
        kind       TEXT NOT NULL,
        by_whom    TEXT NOT NULL,
        fence      INTEGER NOT NULL,
        what       TEXT NOT NULL,
        started_at REAL NOT NULL,
        outcome    TEXT NOT NULL CHECK (outcome = 'started' OR outcome = 'done'
                       OR outcome = 'failed'),
        detail     TEXT,
        ended_at   REAL,
        PRIMARY KEY (task_id, kind)
    ) WITHOUT ROWID;
"""


def _add_effects_schema(c: sqlite3.Connection) -> None:
    """Migration 7 (idempotent: a column already there is not added again)."""
    for name, declaration in _EFFECT_COLUMNS:
        _add_column(c, "tasks", name, declaration)
    for statement in _split(_EFFECT_TABLES):
        c.execute(statement)


def _add_column(c: sqlite3.Connection, table: str, column: str, decl: str) -> None:
    """``ALTER TABLE ... ADD COLUMN`` unless the column is there already (idempotent, like
    every migration). Adding a nullable column rewrites no row."""
    if column not in {r[1] for r in c.execute(f"PRAGMA table_info({table})")}:
        c.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
