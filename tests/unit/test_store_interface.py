"""The SQLite and the PostgreSQL stores satisfy the protocols of store/interface.py.

The assignments are what mypy checks (a missing method or a changed signature fails the
type check); the test checks at run time that every member is there."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.store.db import open_database
from broker_adapter.store.interface import OutboxAPI, ReceiptsAPI, TaskStoreAPI
from broker_adapter.store.outbox import OutboxStore
from broker_adapter.store.postgres import PgDatabase
from broker_adapter.store.receipts import ReceiptStore
from broker_adapter.store.tasks import TaskStore
from tests.support.store_script import T0, stores


def test_the_sqlite_stores_are_the_interface(tmp_path: Path) -> None:
    with open_database(tmp_path / "interface.db") as db:
        s = stores(db, FakeClock(T0))
        _use(s.tasks, s.outbox, s.receipts)


def test_the_postgresql_stores_are_the_interface(pg_url: str) -> None:
    with PgDatabase(pg_url) as db:
        clock = FakeClock(T0)
        _use(TaskStore(db, clock), OutboxStore(db, clock), ReceiptStore(db, clock))


def _use(tasks: TaskStoreAPI, outbox: OutboxAPI, receipts: ReceiptsAPI) -> None:
    assert tasks.counts()["pending"] == 0
    assert outbox.counts()["pending"] == 0
    assert receipts.list() == []


@pytest.mark.parametrize(
    ("api", "impl"),
    [
        (TaskStoreAPI, TaskStore),
        (OutboxAPI, OutboxStore),
        (ReceiptsAPI, ReceiptStore),
    ],
)
def test_every_protocol_method_has_the_same_parameters(api: type, impl: type) -> None:
    members = [n for n, v in vars(api).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert members
    for name in members:
        expected = list(inspect.signature(getattr(api, name)).parameters)
        assert list(inspect.signature(getattr(impl, name)).parameters) == expected, name
