"""Online snapshots of a database file (``broker-adapter backup``), safe while it is in use.

``VACUUM INTO`` copies the database as one read transaction sees it: in WAL mode a reader
never blocks the writers (ingest, workers, dispatcher, purge go on) and they never tear
its view, so the copy is the state of one moment, every committed transaction before it
in full and none after. The copy is compact (free pages left behind), in rollback-journal
mode (``open_database`` switches it to WAL when it is used).

The snapshot is written under a temporary name next to ``out``, created with mode 0600
(it holds every payload and the key of conflict-answer ids, like the database itself),
synced, checked (``PRAGMA integrity_check``), and only then linked to ``out``: an
interrupted backup never leaves a partial file under the name asked for, and an existing
file there is never overwritten.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

from broker_adapter.errors import ConfigError, StoreError
from broker_adapter.store.identity import STORE_ID_KEY
from broker_adapter.store.urls import is_postgres_url, redacted_url

#: The tables a snapshot reports the row counts of (those present).
COUNTED_TABLES = ("tasks", "inbox", "outbox", "receipts")
SNAPSHOT_BUSY_TIMEOUT_MS = 10_000


def write_snapshot(db_path: str | Path, out: str | Path) -> dict[str, Any]:
    """Write a consistent copy of the database at ``db_path`` to ``out`` (which must not
    exist), with mode 0600.

    Returns:
        what was written: ``out``, ``bytes``, ``integrity`` (``"ok"``), ``store_id`` (the
        store's identity, which the copy keeps: ``store.identity``) and the row counts of
        the tables of ``COUNTED_TABLES`` it holds.

    Raises:
        ConfigError: ``db_path`` is not a file, or ``out`` exists already.
        StoreError: SQLite failed, or the copy does not pass its integrity check.
    """
    if is_postgres_url(str(db_path)):
        raise ConfigError(
            f"{redacted_url(str(db_path))}: backup needs a SQLite file; back a PostgreSQL"
            " database up with the server's own tools (pg_dump, base backups)"
        )
    source, target = Path(db_path), Path(out)
    if not source.is_file():
        raise ConfigError(f"no database at {source}")
    if target.exists():
        raise ConfigError(f"{target} exists; a backup never overwrites a file")
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot create {partial}: {exc}") from exc
    os.close(fd)
    try:
        _vacuum_into(source, partial)
        with open(partial, "rb+") as f:
            os.fsync(f.fileno())
        report = _check(partial)
        try:
            os.link(partial, target)  # never replaces an existing file
        except FileExistsError:
            raise ConfigError(f"{target} exists; a backup never overwrites a file") from None
        _sync_dir(target.parent)
    finally:
        partial.unlink(missing_ok=True)
    return {"out": str(target), "bytes": target.stat().st_size, **report}


def _vacuum_into(source: Path, partial: Path) -> None:
    # A plain connection: no migration, no pragma changes on the live file.
    conn = sqlite3.connect(
        str(source), isolation_level=None, timeout=SNAPSHOT_BUSY_TIMEOUT_MS / 1000
    )
    try:
        conn.execute(f"PRAGMA busy_timeout = {SNAPSHOT_BUSY_TIMEOUT_MS}")
        conn.execute("VACUUM INTO ?", (str(partial),))
    except sqlite3.Error as exc:
        raise StoreError(f"cannot snapshot {source}: {exc}") from exc
    finally:
        conn.close()


def _check(path: Path) -> dict[str, Any]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    try:
        integrity = str(conn.execute("PRAGMA integrity_check").fetchone()[0])
        if integrity != "ok":
            raise StoreError(f"snapshot {path} fails its integrity check: {integrity}")
        present = {
            r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        rows = {
            table: int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
            for table in COUNTED_TABLES
            if table in present
        }
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        store_id = None
        if "meta" in present:
            row = conn.execute("SELECT value FROM meta WHERE name = ?", (STORE_ID_KEY,)).fetchone()
            store_id = None if row is None else bytes(row[0]).decode("ascii", "replace")
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read snapshot {path}: {exc}") from exc
    finally:
        conn.close()
    return {"integrity": integrity, "schema_version": version, "store_id": store_id, "rows": rows}


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
