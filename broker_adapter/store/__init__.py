"""Persistence on a SQLite file or a PostgreSQL database: the inbox, the task state
machine, the outbox and reply receipts, one text for both (``sql``).

Only this package imports ``sqlite3`` and ``psycopg``; it never imports redis.
"""

from broker_adapter.store.db import Database, open_database
from broker_adapter.store.outbox import OutboxRow, OutboxStore
from broker_adapter.store.receipts import Receipt, ReceiptOutcome, ReceiptStore
from broker_adapter.store.tasks import (
    AcceptItem,
    AcceptResult,
    ClaimedTask,
    FailOutcome,
    Outcome,
    TaskState,
    TaskStore,
)

__all__ = [
    "AcceptItem",
    "AcceptResult",
    "ClaimedTask",
    "Database",
    "FailOutcome",
    "OutboxRow",
    "OutboxStore",
    "Outcome",
    "Receipt",
    "ReceiptOutcome",
    "ReceiptStore",
    "TaskState",
    "TaskStore",
    "open_database",
]
