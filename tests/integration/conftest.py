"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.protocol.signing import Keyring
from broker_adapter.store import TaskStore, open_database
from broker_adapter.store.db import Database
from tests.support.ingest_script import write_keyring


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


@pytest.fixture
def keyring(tmp_path: Path) -> Keyring:
    """The test keyring (``ingest_script.KEYRING``), written as a 0600 file and loaded."""
    return write_keyring(tmp_path / "keys.json")


@pytest.fixture
def tasks(tmp_path: Path, clock: FakeClock) -> Iterator[TaskStore]:
    """The ingest's task store (``inbox.db``) on the test clock."""
    db = open_database(tmp_path / "inbox.db")
    yield TaskStore(db, clock)
    db.close()
