"""A store's identity: a random id made once in the database itself, so that it names one
inbox (one memory of message ids) wherever the database is opened from.

The id is a ``meta`` row (``STORE_ID_KEY``), made by a migration from the OS's random
source and never changed: a backup restored with ``broker-adapter backup`` keeps it (the
copy holds the row), every process and host that opens one PostgreSQL database reads the
same one, and a new, empty database gets a new one. What binds a Redis prefix to one store
(``app.binding``) compares these ids; the default consumer names derive from them.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from broker_adapter.errors import StoreError

if TYPE_CHECKING:
    from broker_adapter.store.db import Database
    from broker_adapter.store.postgres import PgDatabase

#: The ``meta`` row holding the store's identity (hex text, ``STORE_ID_BYTES`` random bytes).
STORE_ID_KEY = "store_id"
STORE_ID_BYTES = 16


def new_store_id() -> bytes:
    """A fresh identity, as the ``meta`` row stores it (ASCII hex)."""
    return os.urandom(STORE_ID_BYTES).hex().encode("ascii")


@dataclass(frozen=True)
class StoreIdentity:
    """Who a store is, and what it remembers.

    Attributes:
        store_id: the ``meta`` row's id (hex).
        kind: ``sqlite`` or ``postgresql``.
        where: where it was opened from, for people: ``host:/path`` of a SQLite file, the
            URL without its password for PostgreSQL.
        remembered: message ids its inbox holds (what a move to another store forgets).
        oldest_at: when the oldest of them was received (epoch seconds), or ``None``.
    """

    store_id: str
    kind: str
    where: str
    remembered: int
    oldest_at: float | None

    @property
    def short(self) -> str:
        """The first 8 characters of the id, as names and messages show it."""
        return self.store_id[:8]


def store_identity(db: Database | PgDatabase) -> StoreIdentity:
    """The identity of the open database ``db`` and how many message ids it remembers.

    Raises:
        StoreError: the database has no identity (it was not migrated).
    """
    try:
        store_id = db.meta(STORE_ID_KEY).decode("ascii")
    except UnicodeDecodeError as exc:
        raise StoreError(f"{db.path}: its store id is not text") from exc
    row = db.fetch_one("SELECT count(*) AS n, min(received_at) AS oldest FROM inbox")
    remembered, oldest = (0, None) if row is None else (int(row["n"]), row["oldest"])
    path = db.path
    if isinstance(path, Path):
        kind, where = "sqlite", f"{socket.gethostname()}:{path.resolve()}"
    else:
        kind, where = "postgresql", str(path)
    return StoreIdentity(
        store_id=store_id,
        kind=kind,
        where=where,
        remembered=remembered,
        oldest_at=None if oldest is None else float(oldest),
    )
