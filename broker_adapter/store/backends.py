"""Which store a ``--db`` names: a SQLite file (the embedded default) or, for worker pools
across hosts, a PostgreSQL database (``postgresql://user@host:port/dbname``).

The PostgreSQL backend (``store.postgres``) needs the ``postgres`` extra (psycopg 3 and
psycopg-pool); it is imported only when a URL names it, so a SQLite-only installation
never needs the driver.

The store's classes (``TaskStore``, ``OutboxStore``, ``ReceiptStore``, ...) take either
database (``store.sql``). What applies to one backend only:

* ``WriteGate`` (``store.gate``) queues the writers of one SQLite file across the
  processes of a pool; PostgreSQL arbitrates row by row, so ``gate`` is ignored for it.
* ``Database``'s file checks (its mode 0600, ``read_only`` opening the file ``mode=ro``,
  ``integrity_check``) and ``broker-adapter backup`` (``VACUUM INTO``) are SQLite's; a
  PostgreSQL database is backed up with the server's own tools (``pg_dump``, base backups).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from broker_adapter.errors import ConfigError
from broker_adapter.store.db import Database, open_database
from broker_adapter.store.gate import WriteGate
from broker_adapter.store.urls import is_postgres_url

if TYPE_CHECKING:
    from broker_adapter.store.postgres import PgDatabase

__all__ = ["open_store", "probe"]


def open_store(
    target: str | Path, *, gate: WriteGate | None = None, read_only: bool = False
) -> Database | PgDatabase:
    """Open (and, unless ``read_only``, migrate) the database ``target`` names.

    Raises:
        ConfigError: a PostgreSQL URL without the ``postgres`` extra installed, or what
            ``Database`` / ``PgDatabase`` raise for the target.
    """
    if is_postgres_url(target):
        try:
            from broker_adapter.store.postgres import PgDatabase
        except ImportError as exc:
            raise ConfigError(
                f"{exc}: a postgresql:// database needs the 'postgres' extra"
                " (pip install 'broker_adapter[postgres]')"
            ) from exc
        return PgDatabase(str(target), read_only=read_only)
    return open_database(target, gate=gate, read_only=read_only)


def probe(url: str, timeout_s: float) -> str | None:
    """Why the PostgreSQL database at ``url`` cannot be written now (unreachable within
    ``timeout_s``, or a standby in recovery), or None: a readiness check."""
    from broker_adapter.store.postgres.db import probe_postgres

    return probe_postgres(url, timeout_s)
