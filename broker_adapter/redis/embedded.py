"""A throwaway Redis for the demo and quick experiments: a private ``redis-server`` when the
binary is installed, otherwise fakeredis's in-process TCP server (the ``demo`` extra).

Loopback only, a free port, its own temporary directory; ``close()`` removes everything.
Not for production: the fake server keeps nothing on disk and is single-process.
"""

from __future__ import annotations

import threading
import time

from broker_adapter.errors import ConfigError
from broker_adapter.redis.client import connect
from broker_adapter.redis.server import READY_TIMEOUT_S, RedisServer, binary_available, free_port


class EmbeddedRedis:
    """Start with ``EmbeddedRedis.start()``; use ``.url``; ``close()`` when done."""

    def __init__(self) -> None:
        self.url = ""
        self.kind = ""
        self.version = ""
        self._server: RedisServer | None = None
        self._fake: object | None = None

    @classmethod
    def start(cls) -> EmbeddedRedis:
        """Start a redis-server if there is one on the PATH, else the fakeredis server.

        Raises:
            ConfigError: neither is available, or the server did not come up.
        """
        self = cls()
        if binary_available():
            self._start_binary()
        else:
            self._start_fake()
        return self

    def _start_binary(self) -> None:
        server = RedisServer()
        server.start(timeout_s=READY_TIMEOUT_S)
        self._server = server
        self.url = server.url
        self.kind = "redis-server (throwaway, AOF always)"
        self.version = server.version()

    def _start_fake(self) -> None:
        try:
            from fakeredis import TcpFakeServer
        except ImportError as exc:
            raise ConfigError(
                "the demo needs a Redis: install redis-server (Debian/Ubuntu: apt-get install "
                "redis-server; macOS: brew install redis), or the in-process stand-in with "
                "pip install 'broker_adapter[demo]'"
            ) from exc
        port = free_port()
        server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
        threading.Thread(target=server.serve_forever, name="fakeredis", daemon=True).start()
        self._fake = server
        self.url = f"redis://127.0.0.1:{port}/0"
        self.kind = "fakeredis TCP server (in-process, no persistence)"
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            client = connect(self.url, socket_timeout_s=1.0, connect_timeout_s=1.0)
            try:
                if client.ping():
                    self.version = self._server_version(client)
                    return
            except Exception as exc:  # noqa: BLE001 - any failure means "not up yet"
                last = exc
            finally:
                client.close()
            time.sleep(0.02)  # waiting for a child process to listen
        self.close()
        raise ConfigError(f"the embedded Redis did not start: {last}")

    @staticmethod
    def _server_version(client: object) -> str:
        try:
            info = client.info("server")  # type: ignore[attr-defined]
            return str(info.get("redis_version", "?"))
        except Exception:  # noqa: BLE001 - the fake server has no INFO
            return "(fakeredis)"

    def close(self) -> None:
        if self._server is not None:
            self._server.kill()
            self._server.stop()
        if self._fake is not None:
            shutdown = getattr(self._fake, "shutdown", None)
            if callable(shutdown):
                shutdown()

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
