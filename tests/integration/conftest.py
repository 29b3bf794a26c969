"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_adapter.store import open_database
from broker_adapter.store.db import Database


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    """The agent side's database (``agent.db``) of one test, closed afterwards.
    A test module's own ``db`` fixture takes precedence over this one."""
    database = open_database(tmp_path / "agent.db")
    yield database
    database.close()


@pytest.fixture
def agent_db(db: Database) -> Database:
    """The agent side's database under the name the reply tests use."""
    return db


@pytest.fixture
def rx_path(tmp_path: Path) -> Path:
    """The receiver's database file (``receiver.db``)."""
    return tmp_path / "receiver.db"


@pytest.fixture
def rx_db(rx_path: Path) -> Iterator[Database]:
    """The receiver's database of one test, closed afterwards."""
    database = open_database(rx_path)
    yield database
    database.close()
