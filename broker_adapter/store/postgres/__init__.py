"""The PostgreSQL store: the SQLite store's interface and invariants on a server several
adapter processes (on several hosts) share. ``--db postgresql://...`` selects it.

Needs the ``postgres`` extra (psycopg 3 and psycopg-pool). Only ``broker_adapter.store``
imports database drivers. The receipts, the retention purge and the status snapshot are one
text for both stores (``store.receipts``, ``store.retention``, ``store.report``):
``PgReceiptStore`` is ``store.receipts.ReceiptStore``, under the name callers know.
"""

from broker_adapter.store.backends import is_postgres_url
from broker_adapter.store.postgres.db import PgDatabase
from broker_adapter.store.postgres.outbox import PgOutboxStore
from broker_adapter.store.receipts import ReceiptStore as PgReceiptStore

__all__ = ["PgDatabase", "PgOutboxStore", "PgReceiptStore", "is_postgres_url"]
