"""The Redis servers the contract tests (``tests/contract``) run against: a private
redis-server, or fakeredis in process.

A ``Backend`` hands out clients as ``broker_adapter.redis.client.connect`` would (each with a
connection pool of its own, never re-sending a command) and says which server it is, so a
test body can mark what fakeredis does differently (``tests/contract/README.md``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker_adapter.redis.client import connect
from tests.support.redis_server import RedisServer, free_port

REDIS_SERVER = "redis-server"
FAKEREDIS = "fakeredis"
FAKEREDIS_TCP = "fakeredis-tcp"


@dataclass(frozen=True)
class Backend:
    """One Redis of a contract test.

    Attributes:
        name: ``REDIS_SERVER``, ``FAKEREDIS`` or ``FAKEREDIS_TCP`` (the test id's
            parameter).
    """

    name: str
    _connect: Callable[[float], redis.Redis]

    @property
    def is_fake(self) -> bool:
        return self.name in (FAKEREDIS, FAKEREDIS_TCP)

    def connect(self, *, socket_timeout_s: float = 10.0) -> redis.Redis:
        """A new client, as the library's ``connect`` makes one for a stage."""
        return self._connect(socket_timeout_s)

    def client(self) -> redis.Redis:
        """A new client for the test's own reads and writes."""
        return self._connect(10.0)


def real_backend(server: RedisServer) -> Backend:
    """The private redis-server of a test session."""
    return Backend(REDIS_SERVER, lambda timeout: connect(server.url, socket_timeout_s=timeout))


def fake_backend() -> Backend:
    """A fakeredis server of its own (``fakeredis[lua]``), reached through fakeredis's
    in-process connection class: every command runs in the calling thread."""
    import fakeredis

    server = fakeredis.FakeServer()

    def make(timeout: float) -> redis.Redis:
        client: redis.Redis = fakeredis.FakeRedis(
            server=server,
            retry=Retry(NoBackoff(), 0),
            socket_timeout=timeout,
        )
        return client

    return Backend(FAKEREDIS, make)


class FakeTcpServer:
    """fakeredis's TCP server (``TcpFakeServer``, what ``broker-adapter demo`` runs on
    without a redis-server) on a free loopback port, served by a thread of its own."""

    def __init__(self) -> None:
        from fakeredis import TcpFakeServer

        self.port = free_port()
        self._server = TcpFakeServer(("127.0.0.1", self.port), server_type="redis")
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fakeredis-tcp", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


def fake_tcp_backend(server: FakeTcpServer) -> Backend:
    """fakeredis's TCP server, reached by the library's own ``connect``: real sockets and
    redis-py's own connection class, fakeredis's command implementations."""
    return Backend(FAKEREDIS_TCP, lambda timeout: connect(server.url, socket_timeout_s=timeout))
