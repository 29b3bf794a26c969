"""The PostgreSQL schema, one versioned migration at a time, like the SQLite one.

The SQLite store counts its schema in ``PRAGMA user_version`` (``store.db.MIGRATIONS``);
here the count is the table ``schema_migrations``, one row per applied migration
(``version``, what it did, when). Version N means migrations 1 to N were applied, each in
the transaction that recorded it. Never edit a released entry: append a new one.

Version 1 is the SQLite schema as its migrations left it (version 6), in PostgreSQL's
types: times are ``double precision`` seconds like SQLite's ``REAL`` (the clock's floats,
exactly), bodies ``bytea``. What differs, and why:

* ``tasks.seq`` and ``receipts.seq`` (identities) stand in for SQLite's ``rowid``: the
  purge walks both tables oldest first from a cursor (``retention``).
* ``inbox_task`` indexes ``inbox.task_id``: PostgreSQL checks a foreign key of a deleted
  task by a query on the referencing table, a scan of the whole inbox without it (SQLite's
  purge turns the check off instead).
* The state CHECKs are ``IN`` lists (SQLite's migration 3 rewrote them as ``=`` chains
  for its evaluator; PostgreSQL has no such cost).

Several processes on several hosts may open one database at once: ``migrate`` holds a
transaction-scoped advisory lock (``MIGRATION_LOCK``) while it reads and raises the version.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Final

import psycopg
from psycopg.rows import tuple_row

from broker_adapter.store import outcome_schema
from broker_adapter.store.identity import STORE_ID_KEY, new_store_id
from broker_adapter.store.migrations import (
    BOUND_APPROVAL_COLUMNS,
    CONFLICT_ID_KEY,
    recomputed_fingerprints,
)

#: ``pg_advisory_xact_lock`` key of the migrating transaction (any fixed 64-bit number).
MIGRATION_LOCK: Final = 0x62615F736368656D  # "ba_schem"

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "current_version", "migrate"]

_V1_TABLES = """
CREATE TABLE tasks (
    task_id        text PRIMARY KEY,
    seq            bigint GENERATED ALWAYS AS IDENTITY UNIQUE,
    principal      text NOT NULL,
    message_id     text NOT NULL,
    kind           text NOT NULL,
    payload        text NOT NULL,
    fingerprint    text NOT NULL,
    correlation_id text,
    parent_id      text,
    state          text NOT NULL CHECK (state IN ('pending', 'running', 'done', 'failed',
                       'cancelled', 'expired', 'hop_limit', 'unknown', 'waiting_approval')),
    attempts       integer NOT NULL DEFAULT 0,
    max_attempts   integer NOT NULL CHECK (max_attempts BETWEEN 1 AND 10),
    fence          bigint NOT NULL DEFAULT 0,
    owner          text,
    lease_until    double precision,
    not_before     double precision NOT NULL,
    deadline       double precision NOT NULL,
    hops           integer NOT NULL,
    created_at     double precision NOT NULL,
    updated_at     double precision NOT NULL,
    finished_at    double precision,
    result         text,
    error          text,
    CHECK (attempts <= max_attempts)
);
CREATE INDEX tasks_ready ON tasks (not_before) WHERE state = 'pending';
CREATE INDEX tasks_leases ON tasks (lease_until) WHERE state = 'running';
CREATE INDEX tasks_live_deadline ON tasks (deadline) WHERE state IN ('pending', 'running');

CREATE TABLE inbox (
    principal   text NOT NULL,
    message_id  text NOT NULL,
    fingerprint text NOT NULL,
    task_id     text NOT NULL REFERENCES tasks (task_id),
    entry_id    text,
    received_at double precision NOT NULL,
    duplicates  integer NOT NULL DEFAULT 0,
    conflicts   integer NOT NULL DEFAULT 0,
    PRIMARY KEY (principal, message_id)
);
CREATE INDEX inbox_received ON inbox (received_at);
CREATE INDEX inbox_task ON inbox (task_id);

CREATE TABLE outbox (
    reply_id     text PRIMARY KEY,
    task_id      text REFERENCES tasks (task_id),
    principal    text NOT NULL,
    message_id   text NOT NULL,
    status       text NOT NULL,
    body         bytea NOT NULL,
    content_hash text NOT NULL,
    state        text NOT NULL CHECK (state IN ('pending', 'sending', 'sent', 'dead')),
    attempts     integer NOT NULL DEFAULT 0,
    fence        bigint NOT NULL DEFAULT 0,
    owner        text,
    lease_until  double precision,
    not_before   double precision NOT NULL,
    last_error   text,
    entry_id     text,
    created_at   double precision NOT NULL,
    sent_at      double precision,
    replays      integer NOT NULL DEFAULT 0,
    replayed_by  text,
    replayed_at  double precision
);
CREATE UNIQUE INDEX outbox_one_reply_per_task ON outbox (task_id) WHERE task_id IS NOT NULL;
CREATE INDEX outbox_ready ON outbox (not_before, created_at) WHERE state = 'pending';
CREATE INDEX outbox_leases ON outbox (lease_until) WHERE state = 'sending';
CREATE INDEX outbox_state ON outbox (state);
CREATE INDEX outbox_answers ON outbox (created_at) WHERE task_id IS NULL;

CREATE TABLE receipts (
    reply_id      text PRIMARY KEY,
    seq           bigint GENERATED ALWAYS AS IDENTITY UNIQUE,
    content_hash  text NOT NULL,
    principal     text NOT NULL,
    message_id    text,
    task_id       text,
    status        text,
    body          bytea NOT NULL,
    entry_id      text,
    received_at   double precision NOT NULL,
    effects       integer NOT NULL DEFAULT 0,
    effect_result text
);

CREATE TABLE meta (name text PRIMARY KEY, value bytea NOT NULL);
"""


def _v1(conn: psycopg.Connection[Any]) -> None:
    """Migration 1: the tables, and the conflict-id key made once from the OS's random
    source (it never leaves the database)."""
    conn.execute(_V1_TABLES)
    conn.execute(
        "INSERT INTO meta (name, value) VALUES (%s, %s) ON CONFLICT (name) DO NOTHING",
        (CONFLICT_ID_KEY, os.urandom(32)),
    )


# What the SQLite migrations 7 to 9 added, in one step: the effect columns of ``tasks``
# and the effect tables (7), ``tasks.traceparent`` (8), the chain budget's ``chains`` (9).
_V2_TABLES = """
ALTER TABLE tasks ADD COLUMN IF NOT EXISTS cancel_requested_at double precision;
ALTER TABLE tasks ADD COLUMN IF NOT EXISTS effect_fence bigint;
ALTER TABLE tasks ADD COLUMN IF NOT EXISTS effect_started_at double precision;
ALTER TABLE tasks ADD COLUMN IF NOT EXISTS reconcile_tries integer NOT NULL DEFAULT 0;
ALTER TABLE tasks ADD COLUMN IF NOT EXISTS operator_since double precision;
ALTER TABLE tasks ADD COLUMN IF NOT EXISTS traceparent text;
CREATE INDEX IF NOT EXISTS tasks_unknown ON tasks (not_before) WHERE state = 'unknown';

CREATE TABLE IF NOT EXISTS approvals (
    approval_id text PRIMARY KEY,
    action      text NOT NULL,
    target      text NOT NULL,
    scope       text NOT NULL,
    approver    text NOT NULL,
    granted_at  double precision NOT NULL,
    expires_at  double precision NOT NULL,
    revoked_at  double precision,
    revoked_by  text,
    CHECK (expires_at > granted_at)
);
CREATE INDEX IF NOT EXISTS approvals_match ON approvals (action, target, scope, expires_at);
CREATE TABLE IF NOT EXISTS approval_waits (
    task_id text PRIMARY KEY,
    action  text NOT NULL,
    target  text NOT NULL,
    scope   text NOT NULL,
    since   double precision NOT NULL,
    until   double precision NOT NULL
);
CREATE INDEX IF NOT EXISTS approval_waits_until ON approval_waits (until);
CREATE TABLE IF NOT EXISTS reconcile_log (
    task_id  text NOT NULL,
    outcome  text NOT NULL CHECK (outcome IN ('done', 'not-done', 'unknown')),
    by_whom  text NOT NULL,
    at       double precision NOT NULL,
    fence    bigint NOT NULL,
    observed text,
    note     text
);
CREATE INDEX IF NOT EXISTS reconcile_log_task ON reconcile_log (task_id, at);
CREATE TABLE IF NOT EXISTS compensations (
    task_id    text NOT NULL,
    kind       text NOT NULL,
    by_whom    text NOT NULL,
    fence      bigint NOT NULL,
    what       text NOT NULL,
    started_at double precision NOT NULL,
    outcome    text NOT NULL CHECK (outcome IN ('started', 'done', 'failed')),
    detail     text,
    ended_at   double precision,
    PRIMARY KEY (task_id, kind)
);

CREATE TABLE IF NOT EXISTS chains (
    chain_id   text PRIMARY KEY,
    tasks      integer NOT NULL,
    updated_at double precision NOT NULL
);
CREATE INDEX IF NOT EXISTS chains_updated ON chains (updated_at);
"""


def _v2(conn: psycopg.Connection[Any]) -> None:
    """Migration 2: the SQLite schema's versions 7 to 9 (effects, traceparent, chains)."""
    conn.execute(_V2_TABLES)


def _approval_releases(conn: psycopg.Connection[Any]) -> None:
    """Migration 3: the SQLite schema's version 10 (approval releases)."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS approval_releases (task_id text NOT NULL,"
        " approval_id text NOT NULL, released_at double precision NOT NULL,"
        " PRIMARY KEY (task_id, approval_id))"
    )


def _task_name(conn: psycopg.Connection[Any]) -> None:
    """Migration 4: ``tasks.task_name`` (SQLite version 11), the envelope's ``task``."""
    conn.execute("ALTER TABLE tasks ADD COLUMN IF NOT EXISTS task_name text")


def _outcomes(conn: psycopg.Connection[Any]) -> None:
    """Migration 5: the SQLite schema's version 12 (``outcome_schema``)."""
    outcome_schema.postgres_migration(conn)


def _bound_terms_and_approvals(conn: psycopg.Connection[Any]) -> None:
    """Migration 6: the SQLite schema's version 13 (``migrations._bind_terms_and_approvals``)."""
    cur = conn.cursor(row_factory=tuple_row)
    for table, name, declaration in BOUND_APPROVAL_COLUMNS:
        cur.execute(
            f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {name}"
            f" {declaration.replace('INTEGER', 'integer').replace('TEXT', 'text')}"
        )
    rows = cur.execute(
        "SELECT task_id, kind, payload, correlation_id, parent_id, deadline, max_attempts,"
        " fingerprint, task_name FROM tasks"
    ).fetchall()
    for task_id, new, old in recomputed_fingerprints(rows):
        cur.execute("UPDATE tasks SET fingerprint = %s WHERE task_id = %s", (new, task_id))
        cur.execute(
            "UPDATE inbox SET fingerprint = %s WHERE task_id = %s AND fingerprint = %s",
            (new, task_id, old),
        )


def _store_id(conn: psycopg.Connection[Any]) -> None:
    """Migration 7: the SQLite schema's version 14, the store's identity
    (``store.identity``), made once: every host that opens this database reads the same
    one."""
    conn.execute(
        "INSERT INTO meta (name, value) VALUES (%s, %s) ON CONFLICT (name) DO NOTHING",
        (STORE_ID_KEY, new_store_id()),
    )


def _request_kid(conn: psycopg.Connection[Any]) -> None:
    """Migration 8: the key id a request's signature verified with (SQLite version 15)."""
    conn.execute("ALTER TABLE tasks ADD COLUMN IF NOT EXISTS request_kid text")


#: ``(what it does, how)``, one per version, in order.
MIGRATIONS: Final[tuple[tuple[str, Callable[[psycopg.Connection[Any]], None]], ...]] = (
    ("tasks, inbox, outbox, receipts and meta (the SQLite schema at its version 6)", _v1),
    ("effect columns and tables, tasks.traceparent, chains (SQLite versions 7 to 9)", _v2),
    (
        "approval_releases: which approval released a waiting task (SQLite version 10)",
        _approval_releases,
    ),
    ("tasks.task_name (SQLite version 11)", _task_name),
    ("counters, overdue operator waits, effect evidence (SQLite version 12)", _outcomes),
    (
        "fingerprints cover deadline and max_attempts; approvals bound (SQLite version 13)",
        _bound_terms_and_approvals,
    ),
    ("the store's identity, a meta row (SQLite version 14)", _store_id),
    ("tasks.request_kid (SQLite version 15)", _request_kid),
)
SCHEMA_VERSION: Final = len(MIGRATIONS)

_CREATE_VERSIONS = (
    "CREATE TABLE IF NOT EXISTS schema_migrations (version integer PRIMARY KEY,"
    " description text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
)


def current_version(conn: psycopg.Connection[Any]) -> int:
    """The schema version of the connected database (0: none of ours yet)."""
    cur = conn.cursor(row_factory=tuple_row)
    row = cur.execute("SELECT to_regclass('schema_migrations') IS NOT NULL").fetchone()
    if row is None or not row[0]:
        return 0
    got = cur.execute("SELECT coalesce(max(version), 0) FROM schema_migrations").fetchone()
    return int(got[0]) if got is not None else 0


def migrate(conn: psycopg.Connection[Any]) -> int:
    """Bring the database up to ``SCHEMA_VERSION`` in ONE transaction (all or nothing).

    Returns:
        the version found before (``SCHEMA_VERSION`` when there was nothing to do).

    Raises:
        SchemaTooNew: the database was made by a newer library.
    """
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        conn.execute(_CREATE_VERSIONS)
        found = current_version(conn)
        if found > SCHEMA_VERSION:
            raise SchemaTooNew(found)
        for number in range(found, SCHEMA_VERSION):
            description, apply = MIGRATIONS[number]
            apply(conn)
            conn.execute(
                "INSERT INTO schema_migrations (version, description) VALUES (%s, %s)",
                (number + 1, description),
            )
    return found


class SchemaTooNew(Exception):
    """The database's schema version is above ``SCHEMA_VERSION``."""

    def __init__(self, version: int) -> None:
        self.version = version
        super().__init__(f"schema version {version}, this library knows {SCHEMA_VERSION}")
