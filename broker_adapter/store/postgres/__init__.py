"""The PostgreSQL store's own parts: the connection pool and its transactions (``db``), the
schema and its migrations (``schema``). ``--db postgresql://...`` selects it; the store's
classes (``TaskStore``, ``OutboxStore``, ``ReceiptStore``, and through a task store's
``tx`` ``EffectsStore`` and ``ApprovalStore``) are one text for both databases
(``store.sql``) and take a ``PgDatabase`` as they take a SQLite ``Database``.

Needs the ``postgres`` extra (psycopg 3 and psycopg-pool). Only ``broker_adapter.store``
imports database drivers.
"""

from broker_adapter.store.postgres.db import PgDatabase

__all__ = ["PgDatabase"]
