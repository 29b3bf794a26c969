"""The schema of bounded uncertain outcomes, for both stores (SQLite migration 10,
PostgreSQL migration 3): one migration, written once per engine here so that
``migrations.py`` and ``postgres/schema.py`` each gain one line.

* ``counters``: the counts that never fall (``store.counters``), seeded with what the
  effect records held before, so that the reconcile and compensation counters go on from
  the values they had instead of falling to 0 at the upgrade.
* ``tasks.operator_overdue_at``: when a task's wait for an operator passed
  ``ReconcilePolicy.operator_timeout_s`` (and the alert was raised); compared with
  ``operator_since``, so a later wait of the same task starts a new bound.
* evidence: ``tasks.effect_key_digest`` and ``tasks.adapter_version`` (set when an attempt
  marks its effect started), and the same two columns on every ``reconcile_log`` and
  ``compensations`` record, so each record says which effect (the SHA-256 of its
  idempotency key) and which adapter version wrote it.
"""

from __future__ import annotations

import sqlite3
from typing import Any

#: ``(table, column)`` added by this migration; the declaration is nullable text or real.
_COLUMNS = (
    ("tasks", "operator_overdue_at", "REAL", "double precision"),
    ("tasks", "effect_key_digest", "TEXT", "text"),
    ("tasks", "adapter_version", "TEXT", "text"),
    ("reconcile_log", "effect_key_digest", "TEXT", "text"),
    ("reconcile_log", "adapter_version", "TEXT", "text"),
    ("compensations", "effect_key_digest", "TEXT", "text"),
    ("compensations", "adapter_version", "TEXT", "text"),
)

#: Both engines: the counters of the records already kept (``WHERE true``: SQLite's parser
#: needs it between a SELECT and ON CONFLICT).
_SEED = (
    "INSERT INTO counters (name, slot, value) SELECT 'reconciled_' || outcome, 0, count(*)"
    " FROM reconcile_log WHERE true GROUP BY outcome ON CONFLICT (name, slot) DO NOTHING",
    "INSERT INTO counters (name, slot, value) SELECT 'compensations_started', 0, count(*)"
    " FROM compensations WHERE true HAVING count(*) > 0 ON CONFLICT (name, slot) DO NOTHING",
    "INSERT INTO counters (name, slot, value) SELECT 'compensations_' || outcome, 0, count(*)"
    " FROM compensations WHERE outcome <> 'started' GROUP BY outcome"
    " ON CONFLICT (name, slot) DO NOTHING",
)

_SQLITE_COUNTERS = (
    "CREATE TABLE IF NOT EXISTS counters (name TEXT NOT NULL, slot INTEGER NOT NULL,"
    " value INTEGER NOT NULL, PRIMARY KEY (name, slot)) WITHOUT ROWID"
)
_PG_COUNTERS = (
    "CREATE TABLE IF NOT EXISTS counters (name text NOT NULL, slot integer NOT NULL,"
    " value bigint NOT NULL, PRIMARY KEY (name, slot))"
)


def sqlite_migration(c: sqlite3.Connection) -> None:
    """SQLite migration 10 (idempotent: a column already there is not added again)."""
    for table, column, declaration, _ in _COLUMNS:
        if column not in {r[1] for r in c.execute(f"PRAGMA table_info({table})")}:
            c.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
    c.execute(_SQLITE_COUNTERS)
    for statement in _SEED:
        c.execute(statement)


def postgres_migration(conn: Any) -> None:
    """PostgreSQL migration 3 (``conn``: a psycopg connection in the migration's
    transaction)."""
    for table, column, _, declaration in _COLUMNS:
        conn.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {declaration}")
    conn.execute(_PG_COUNTERS)
    for statement in _SEED:
        conn.execute(statement)
