"""Throwaway PostgreSQL databases for tests, on the machine's PostgreSQL server.

A ``ThrowawayDatabase`` is ``CREATE DATABASE ba_test_<random>`` on the server named by
``BA_TEST_POSTGRES`` (a libpq URL of a database to connect to for the CREATE and DROP;
default ``postgresql://postgres@127.0.0.1:5432/postgres``), and ``DROP DATABASE ... WITH
(FORCE)`` when the session is done. Each test then gets a schema of its own in it
(``fresh_schema``: a URL whose ``search_path`` is that schema), so no test sees another's
rows: a schema is made in milliseconds, a database in about half a second. Without a
reachable server, or without psycopg installed, ``require_server`` skips the test with the
reason, except under ``CI=true`` (any value of ``CI`` but empty, ``0``, ``false`` or ``no``):
there it fails the test, so a CI run whose server is missing cannot pass by skipping every
PostgreSQL test.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Mapping
from functools import cache
from urllib.parse import quote, urlsplit, urlunsplit

import pytest

ENV_SERVER = "BA_TEST_POSTGRES"
DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
#: The store backends the store and invariant suites run on (``store_target``).
STORE_BACKENDS = ("sqlite", "postgresql")
#: Prefix of every database these fixtures create (``ba_test_<16 hex digits>``).
NAME_PREFIX = "ba_test_"


def server_url() -> str:
    return os.environ.get(ENV_SERVER, DEFAULT_SERVER)


def with_database(url: str, name: str) -> str:
    """``url`` naming the database ``name`` instead (same host, port, user, options)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


@cache
def unavailable() -> str | None:
    """Why no throwaway database can be made here, or None when one can (asked once)."""
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install -e '.[postgres]')"
    try:
        with psycopg.connect(server_url(), connect_timeout=3, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"no PostgreSQL server at {server_url()} ({ENV_SERVER}): {first}"
    return None


def in_ci(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the run is a CI run: ``CI`` set to anything but empty, ``0``, ``false`` or
    ``no`` (case ignored)."""
    value = (os.environ if environ is None else environ).get("CI", "")
    return value.strip().lower() not in ("", "0", "false", "no")


def require_server(environ: Mapping[str, str] | None = None) -> None:
    """Skip the calling test when no PostgreSQL server is reachable; under CI
    (``in_ci``) fail it instead: there a missing server is a broken run, not a reason."""
    reason = unavailable()
    if reason is None:
        return
    if in_ci(environ):
        pytest.fail(f"CI=true and {reason}: PostgreSQL tests must run in CI", pytrace=False)
    pytest.skip(reason)


class ThrowawayDatabase:
    """One fresh, empty database on the server; ``drop`` removes it (and its sessions)."""

    def __init__(self, template: ThrowawayDatabase | None = None) -> None:
        """A new empty database, or with ``template`` a copy of that one (which nobody
        may be connected to; a session just closed may take a moment to end)."""
        import psycopg

        self.name = NAME_PREFIX + secrets.token_hex(8)
        sql = f'CREATE DATABASE "{self.name}"'
        if template is not None:
            sql += f' TEMPLATE "{template.name}"'
        give_up = time.monotonic() + 10.0
        with psycopg.connect(server_url(), autocommit=True) as conn:
            while True:
                try:
                    conn.execute(sql)
                    break
                except psycopg.errors.ObjectInUse:
                    if time.monotonic() > give_up:
                        raise
                    time.sleep(0.05)  # polling the end of the template's last session
        self.url = with_database(server_url(), self.name)

    def fresh_schema(self) -> str:
        """A new empty schema in this database: the URL of a session that works in it
        (its ``search_path``), for the test's stores and the processes it starts."""
        import psycopg

        schema = "t_" + secrets.token_hex(6)
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{schema}"')
        options = quote(f"-csearch_path={schema}", safe="")
        return f"{self.url}?options={options}"

    def drop(self) -> None:
        import psycopg

        with psycopg.connect(server_url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
