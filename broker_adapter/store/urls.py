"""What a ``--db`` string says before any database is opened: whether it names a
PostgreSQL database (``is_postgres_url``), and how it may be shown (``redacted_url``).

No driver and no other store module is imported here: ``backends`` (which opens the
database a URL names) and ``postgres`` (the driver's side) both use it.
"""

from __future__ import annotations

from typing import Final
from urllib.parse import urlsplit, urlunsplit

#: URL schemes that select the PostgreSQL backend.
POSTGRES_SCHEMES: Final = ("postgresql://", "postgres://")


def is_postgres_url(target: object) -> bool:
    """Whether ``target`` (a ``--db`` value) names a PostgreSQL database."""
    return isinstance(target, str) and target.startswith(POSTGRES_SCHEMES)


def redacted_url(url: str) -> str:
    """``url`` without its password (``user:secret@`` becomes ``user@``, a ``password=``
    query parameter's value becomes ``***``): what messages and logs may show."""
    parts = urlsplit(url)
    if parts.password is not None:
        host = parts.netloc.rsplit("@", 1)[1]
        parts = parts._replace(netloc=f"{parts.username or ''}@{host}")
    if "password" in parts.query.lower():
        query = "&".join(
            f"{p.split('=', 1)[0]}=***" if p.split("=", 1)[0].lower() == "password" else p
            for p in parts.query.split("&")
        )
        parts = parts._replace(query=query)
    return urlunsplit(parts)
