"""What the console reads from: the adapters' stores (one or more ``--db``) and Redis (the
dead-letter streams), and how a value is shown safely.

Each store is opened once, when the console starts, and shared by the request threads
(both databases hand out one short transaction at a time: ``store.sql.Db``). The labels
of PostgreSQL URLs lose their password (``backends.redacted_url``).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from broker_adapter.app.ops import dead_letter_entries
from broker_adapter.errors import ConfigError
from broker_adapter.store.backends import open_store
from broker_adapter.store.db import Database
from broker_adapter.store.urls import is_postgres_url, redacted_url

if TYPE_CHECKING:
    from broker_adapter.store.postgres import PgDatabase

#: Dead-letter entries read per dead-letter stream for a page (the newest).
DEAD_LETTERS_SHOWN: Final = 200

#: Members of a payload or result whose value is never shown (case-insensitive, anywhere
#: in the member's name).
SECRET_NAMES: Final = re.compile(
    r"secret|passw|token|api[_-]?key|authori[sz]ation|cookie|credential|private[_-]?key",
    re.IGNORECASE,
)
REDACTED: Final = "[redacted]"


@dataclass(frozen=True)
class Store:
    """One adapter's store as the console lists it."""

    label: str
    db: Database | PgDatabase


def open_stores(targets: list[str]) -> list[Store]:
    """Open every ``--db`` (a SQLite file or a postgresql:// URL), in order.

    Raises:
        ConfigError: a SQLite file that does not exist (none is created), or what
            ``open_store`` raises.
    """
    for target in targets:
        if not is_postgres_url(target) and not Path(target).is_file():
            raise ConfigError(f"--db {target}: no such database file (start its adapter first)")
    stores: list[Store] = []
    try:
        for target in targets:
            label = redacted_url(target) if is_postgres_url(target) else str(target)
            stores.append(Store(label, open_store(target)))
    except BaseException:
        for store in stores:
            store.db.close()
        raise
    return stores


def redact(value: Any) -> Any:
    """``value`` with the value of every member whose name looks like a secret replaced
    by ``REDACTED`` (at any depth)."""
    if isinstance(value, dict):
        return {
            k: REDACTED if isinstance(k, str) and SECRET_NAMES.search(k) else redact(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def shown(value: Any) -> str:
    """A JSON value as text for a page: secrets redacted, indented. The template escapes
    it (autoescape): markup in a payload is shown as text."""
    return json.dumps(redact(value), indent=2, sort_keys=True, ensure_ascii=False, default=str)


def dead_letters(client: Any, prefix: str) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The newest dead-letter entries of every dead-letter stream (at most
    ``DEAD_LETTERS_SHOWN`` per stream), newest first, and how many of them per reason."""
    entries = dead_letter_entries(client, prefix, limit=DEAD_LETTERS_SHOWN)
    entries.reverse()
    by_reason = Counter(str(e["reason"]) for e in entries)
    return entries, dict(sorted(by_reason.items()))
