"""What the health endpoint asks of the database, without opening it as a ``Database``."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

#: The driver's error class, for callers that report database trouble without importing it.
DatabaseError: type[Exception] = sqlite3.Error


def writable_check(path: Path, timeout_s: float) -> Callable[[], str | None]:
    """A check that the file exists and its write lock can be had within ``timeout_s``:
    ``BEGIN IMMEDIATE`` then ``ROLLBACK`` (nothing written, no fsync, the lock held for
    microseconds). A file another writer keeps locked longer counts as not writable.

    Returns:
        a function answering the problem, or ``None`` when the database is writable.
    """

    def check() -> str | None:
        try:
            conn = sqlite3.connect(
                f"file:{path}?mode=rw", uri=True, timeout=timeout_s, isolation_level=None
            )
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("ROLLBACK")
            finally:
                conn.close()
        except sqlite3.Error as exc:
            return f"database: {exc}"
        return None

    return check
