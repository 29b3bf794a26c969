"""Shared fixtures: private redis-servers, databases in tmp_path or on the local PostgreSQL
server, a fake clock."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker_adapter import crashpoints
from broker_adapter.clock import FakeClock
from broker_adapter.store import TaskStore, open_database
from broker_adapter.store.db import Database
from tests.support.postgres import STORE_BACKENDS, ThrowawayDatabase, require_server
from tests.support.redis_server import RedisServer, require_binary


@pytest.fixture(autouse=True)
def _reset_crashpoints(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(crashpoints.ENV_CRASH, raising=False)
    monkeypatch.delenv(crashpoints.ENV_PAUSE, raising=False)
    crashpoints.reset()
    yield
    crashpoints.reset()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One private redis-server shared by a test session; tests use unique key prefixes."""
    require_binary()
    server = RedisServer(tmp_path_factory.mktemp("redis-shared"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def fresh_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own (AOF always), for tests that kill or restart it."""
    require_binary()
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client()
    yield client
    client.close()


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session")
def pg_database() -> Iterator[ThrowawayDatabase]:
    """A throwaway PostgreSQL database for the session, dropped at its end (skips the
    test when no server is reachable: ``tests.support.postgres``)."""
    require_server()
    database = ThrowawayDatabase()
    yield database
    database.drop()


@pytest.fixture
def pg_url(pg_database: ThrowawayDatabase) -> str:
    """The URL of an empty schema of the test's own in the session's PostgreSQL database."""
    return pg_database.fresh_schema()


@pytest.fixture(params=STORE_BACKENDS)
def store_target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a parametrised store test keeps its database: a SQLite file in ``tmp_path``,
    or an empty schema on the local PostgreSQL server (``pg_url``; skipped without one).
    Open it with ``tests.support.store_script.open_any``."""
    if request.param == "sqlite":
        return str(tmp_path / "store.db")
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    """The agent side's database (``agent.db``) of one test, closed afterwards.
    A directory's or a test module's own ``db`` fixture takes precedence over this one."""
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
def tasks(tmp_path: Path, clock: FakeClock) -> Iterator[TaskStore]:
    """The ingest's task store (``inbox.db``) on the test clock."""
    db = open_database(tmp_path / "inbox.db")
    yield TaskStore(db, clock)
    db.close()
