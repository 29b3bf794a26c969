"""The pytest plugin of broker_adapter: fixtures for an application's own tests.

pytest loads it by itself once broker_adapter is installed (the ``pytest11`` entry point).
Every fixture name starts with ``ba_`` so that it cannot shadow one of yours.

- ``ba_redis_server`` (session): a private ``redis-server`` on a free loopback port, with a
  temporary data directory, stopped at the end of the session. The test is skipped, saying
  why, where ``redis-server`` is not installed (and fails under ``CI=true``).
- ``ba_redis_url``: that server's URL.
- ``ba_prefix``: a stream prefix no other test uses, so tests can share the server.
- ``ba_keyring``: a keyring file of the test's own with principals ``agent`` and
  ``adapter`` (``ba_keyring.path`` is the file to pass to ``--keyring``).
- ``ba_adapter``: a factory of running ``broker-adapter run`` processes on all of the above.
- ``ba_client``: a ``Client`` of principal ``agent`` on that server and prefix.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from broker_adapter.client.request import Client
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.server import RedisServer, binary_available
from broker_adapter.testing.adapter import RunningAdapter
from broker_adapter.testing.keyrings import write_keyring


@dataclass(frozen=True)
class KeyringFile:
    """A keyring written for one test: ``path`` for the CLI, ``keyring`` for Python."""

    path: Path
    keyring: Keyring


@pytest.fixture(scope="session")
def ba_redis_server() -> Iterator[RedisServer]:
    """A private redis-server for the test session."""
    if not binary_available():
        reason = "redis-server is not installed (the ba_redis_server fixture runs one)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def ba_redis_url(ba_redis_server: RedisServer) -> str:
    """The URL of the session's private redis-server."""
    return ba_redis_server.url


@pytest.fixture
def ba_prefix() -> str:
    """A stream prefix of the test's own."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def ba_keyring(tmp_path: Path) -> KeyringFile:
    """A keyring file with principals ``agent`` and ``adapter``."""
    path = tmp_path / "keyring.json"
    return KeyringFile(path, write_keyring(path, ("agent", "adapter")))


@pytest.fixture
def ba_adapter(
    ba_redis_url: str, ba_prefix: str, ba_keyring: KeyringFile, tmp_path: Path
) -> Iterator[Callable[..., RunningAdapter]]:
    """A factory of running adapters: ``ba_adapter(handler="mod:func")`` (or
    ``app="mod:router"``, ``app_dir=...``, ``args=[...]``) starts ``broker-adapter run`` on
    ``ba_redis_url`` with ``ba_prefix``, ``ba_keyring`` and a SQLite file of the test's own,
    waits until it reads, and stops it (SIGTERM) after the test."""
    started: list[RunningAdapter] = []

    def start(
        *,
        handler: str | None = None,
        app: str | None = None,
        app_dir: str | Path = ".",
        args: Sequence[str] = (),
    ) -> RunningAdapter:
        if (handler is None) == (app is None):
            raise ValueError("ba_adapter: give handler='mod:func' or app='mod:router'")
        target = ("--handler", handler) if handler is not None else ("--app", str(app))
        adapter = RunningAdapter(
            redis_url=ba_redis_url,
            db=tmp_path / f"adapter-{len(started)}.db",
            keyring=ba_keyring.path,
            prefix=ba_prefix,
            target=target,
            app_dir=app_dir,
            extra_args=args,
        )
        started.append(adapter)
        return adapter.start()

    yield start
    for adapter in started:
        adapter.stop()


@pytest.fixture
def ba_client(ba_redis_url: str, ba_prefix: str, ba_keyring: KeyringFile) -> Iterator[Client]:
    """A ``Client`` of principal ``agent`` (instance ``test``), closed after the test."""
    with Client(
        ba_redis_url, "agent", ba_keyring.keyring, prefix=ba_prefix, instance="test"
    ) as client:
        yield client
