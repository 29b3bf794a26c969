"""The PostgreSQL store: the SQLite store's interface and invariants on a server several
adapter processes (on several hosts) share. ``--db postgresql://...`` selects it.

Needs the ``postgres`` extra (psycopg 3 and psycopg-pool). Only ``broker_adapter.store``
imports database drivers.
"""

from broker_adapter.store.backends import is_postgres_url
from broker_adapter.store.outbox import OutboxStore as PgOutboxStore  # one class, both stores
from broker_adapter.store.postgres.db import PgDatabase
from broker_adapter.store.postgres.receipts import PgReceiptStore
from broker_adapter.store.postgres.tasks import PgTaskStore

__all__ = ["PgDatabase", "PgOutboxStore", "PgReceiptStore", "PgTaskStore", "is_postgres_url"]
