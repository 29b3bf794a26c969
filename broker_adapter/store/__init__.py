"""Persistence on a SQLite file or a PostgreSQL database: the inbox, the task state
machine, the outbox and reply receipts, one text for both (``sql``).

Only this package imports ``sqlite3`` and ``psycopg``; it never imports redis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker_adapter.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from broker_adapter.store.db import Database, open_database
    from broker_adapter.store.inbox import AcceptItem, AcceptResult, Outcome
    from broker_adapter.store.outbox import OutboxStore
    from broker_adapter.store.outbox_types import OutboxRow
    from broker_adapter.store.receipts import Receipt, ReceiptOutcome, ReceiptStore
    from broker_adapter.store.settle import FailOutcome
    from broker_adapter.store.task_types import ClaimedTask, TaskState
    from broker_adapter.store.tasks import TaskStore

#: Each public name, and the module and attribute it is read from when first used.
_EXPORTS: dict[str, tuple[str, str]] = {
    "AcceptItem": ("broker_adapter.store.inbox", "AcceptItem"),
    "AcceptResult": ("broker_adapter.store.inbox", "AcceptResult"),
    "ClaimedTask": ("broker_adapter.store.task_types", "ClaimedTask"),
    "Database": ("broker_adapter.store.db", "Database"),
    "FailOutcome": ("broker_adapter.store.settle", "FailOutcome"),
    "open_database": ("broker_adapter.store.db", "open_database"),
    "OutboxRow": ("broker_adapter.store.outbox_types", "OutboxRow"),
    "OutboxStore": ("broker_adapter.store.outbox", "OutboxStore"),
    "Outcome": ("broker_adapter.store.inbox", "Outcome"),
    "Receipt": ("broker_adapter.store.receipts", "Receipt"),
    "ReceiptOutcome": ("broker_adapter.store.receipts", "ReceiptOutcome"),
    "ReceiptStore": ("broker_adapter.store.receipts", "ReceiptStore"),
    "TaskState": ("broker_adapter.store.task_types", "TaskState"),
    "TaskStore": ("broker_adapter.store.tasks", "TaskStore"),
}

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

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
