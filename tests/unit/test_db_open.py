"""Opening a database while another connection holds its write lock."""

from __future__ import annotations

import sqlite3
import threading
from contextlib import closing
from pathlib import Path

import pytest

from broker_adapter.app.adapter import Adapter
from broker_adapter.app.adapter_config import AdapterConfig
from broker_adapter.errors import ConfigError, RedisUnavailable, StoreBusy, StoreError
from broker_adapter.store import open_database
from broker_adapter.store.db import Database
from tests.support.ingest_script import write_keyring


def _hold_write_lock(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    return conn


def test_a_current_database_opens_while_a_writer_holds_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    open_database(path).close()
    holder = _hold_write_lock(path)
    try:
        db = Database(path, busy_timeout_ms=1)  # would fail at once if it took the lock
        db.close()
    finally:
        holder.close()


def test_a_database_to_migrate_behind_a_held_lock_is_busy_not_broken(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    sqlite3.connect(path).execute("PRAGMA journal_mode = WAL").close()  # schema version 0
    holder = _hold_write_lock(path)
    try:
        with pytest.raises(StoreBusy):
            Database(path, busy_timeout_ms=1)
    finally:
        holder.close()
    open_database(path).close()  # the lock gone, it migrates


def test_the_runner_waits_for_a_locked_database_and_a_stop_ends_the_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "adapter.db"
    calls: list[int] = []

    def locked(*_args: object, **_kwargs: object) -> Database:
        calls.append(1)
        raise StoreBusy("database is locked")

    monkeypatch.setattr("broker_adapter.app.adapter.open_store", locked)
    keyring = write_keyring(tmp_path / "keyring.json")
    config = AdapterConfig(
        redis_url="redis://127.0.0.1:1/0",
        db_path=path,
        handler="broker_adapter.examples:echo",
        keyring_path=tmp_path / "keyring.json",
    )
    assert keyring.principals
    runner = Adapter(config)  # busy at start-up is not an error
    assert calls == [1]
    stop = threading.Event()
    waits: list[float | None] = []

    def wait(timeout: float | None = None) -> bool:
        waits.append(timeout)
        return len(waits) >= 3  # the third pause is cut short by a stop

    monkeypatch.setattr(stop, "wait", wait)
    assert runner.run(stop) == 0
    assert len(calls) == 3  # tried again after each of the first two pauses
    assert waits[0] is not None
    assert waits[1] == 2 * waits[0]


def test_a_stage_retries_opening_its_store_and_connecting_while_they_fail_transiently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage's own store (a PostgreSQL session killed as it opens) and its Redis client
    (a cluster whose seed node is restarting) are retried, not the end of the stage; a
    stop ends the wait with nothing opened."""
    path = tmp_path / "adapter.db"
    write_keyring(tmp_path / "keyring.json")
    config = AdapterConfig(
        redis_url="redis://127.0.0.1:1/0",
        db_path=path,
        handler="broker_adapter.examples:echo",
        keyring_path=tmp_path / "keyring.json",
    )
    runner = Adapter(config)
    stop = threading.Event()
    monkeypatch.setattr(stop, "wait", lambda timeout=None: False)  # backoffs take no time
    failures = [StoreBusy("terminating connection due to administrator command")] * 2
    opened: list[Database] = []

    def flaky_open(*args: object, **kwargs: object) -> Database:
        if failures:
            raise failures.pop()
        opened.append(open_database(path))
        return opened[-1]

    monkeypatch.setattr("broker_adapter.app.adapter.open_store", flaky_open)
    reads = [StoreBusy("the store's first read, on a killed session")]

    def first_read(db: Database) -> Database:
        if reads:
            raise reads.pop()
        return db

    store = runner._store(stop, None, first_read)  # type: ignore[arg-type]
    assert store is not None
    assert store is opened[-1]
    assert not failures
    assert not reads
    assert len(opened) == 2  # the database of the failed first read was closed, not reused
    store.close()
    unreachable = [RedisUnavailable("redis cluster unreachable: seed node down")] * 2

    def flaky_connect(url: str) -> str:
        if unreachable:
            raise unreachable.pop()
        return "client"

    monkeypatch.setattr("broker_adapter.app.adapter.connect", flaky_connect)
    assert runner._connect(stop) == "client"  # type: ignore[comparison-overlap]
    stopped = threading.Event()
    stopped.set()
    failures.append(StoreBusy("still down"))
    assert runner._store(stopped, None, lambda db: db) is None


# -- read-only opens (status, receipts) ------------------------------------------------------


def test_a_read_only_open_of_a_missing_file_is_refused_and_creates_nothing(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match="no database at"):
        Database(tmp_path / "typo.db", read_only=True)
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_open_reads_and_refuses_to_write(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    open_database(path).close()
    path.chmod(0o644)  # a read-write open would tighten it
    db = Database(path, read_only=True)
    try:
        assert db.fetch_one("SELECT count(*) FROM tasks")[0] == 0  # type: ignore[index]
        with pytest.raises(StoreError, match="read-only"), db.write("anything"):
            pass
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            db.conn.execute("INSERT INTO meta (name, value) VALUES ('x', 'y')")
    finally:
        db.close()
    assert path.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize(
    ("version", "needle"),
    [(0, "is not a broker_adapter database"), (1, "migrates it"), (99, "upgrade")],
)
def test_a_read_only_open_needs_the_current_schema(
    tmp_path: Path, version: int, needle: str
) -> None:
    path = tmp_path / "old.db"
    with closing(sqlite3.connect(path)) as conn:
        conn.execute(f"PRAGMA user_version = {version}")
    with pytest.raises(StoreError, match=needle):
        Database(path, read_only=True)
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == version  # not migrated
