"""A private ``redis-server`` process: a free loopback port, a data directory of its own,
killable and restartable.

It is what ``broker-adapter demo`` runs on, what ``broker_adapter.testing`` gives a user's
tests, and what this project's own tests use. It never touches a Redis it did not start.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from broker_adapter.errors import ConfigError

REDIS_BINARY = "redis-server"
READY_TIMEOUT_S = 10.0
_PORT_TRIES = 5


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def binary_available() -> bool:
    """Whether ``redis-server`` is on the PATH."""
    return shutil.which(REDIS_BINARY) is not None


class RedisServer:
    """One redis-server process on 127.0.0.1.

    Args:
        workdir: its data directory (the AOF lives here, so a restart keeps the data);
            ``None`` makes a temporary one that ``stop`` removes.
        appendfsync: ``always`` (default), ``everysec`` or ``no``; ``None`` turns the AOF off.
        extra_args: more ``redis-server`` arguments, e.g. ``["--maxmemory", "64mb"]``.

    Use as a context manager, or ``start()`` and ``stop()``::

        with RedisServer() as server:
            client = server.client()
    """

    def __init__(
        self,
        workdir: Path | None = None,
        appendfsync: str | None = "always",
        extra_args: list[str] | None = None,
    ) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="ba-redis-")) if workdir is None else workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.appendfsync = appendfsync
        self.extra_args = list(extra_args or [])
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        """The server's command line."""
        args = [
            REDIS_BINARY,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(self.workdir / "redis.log"),
            "--enable-debug-command",
            "local",
            "--aof-load-truncated",
            "yes",
        ]
        if self.appendfsync is None:
            args += ["--appendonly", "no"]
        else:
            args += ["--appendonly", "yes", "--appendfsync", self.appendfsync]
        return args + self.extra_args

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start the server and wait until it answers PING with its data loaded.

        Raises:
            ConfigError: ``redis-server`` is not installed, or did not come up.
        """
        if not binary_available():
            raise ConfigError(
                "redis-server is not on the PATH: install it (Debian/Ubuntu: "
                "apt-get install redis-server; macOS: brew install redis)"
            )
        for _ in range(_PORT_TRIES):
            self._spawn()
            if self._wait_ready(timeout_s):
                return
            self.stop(remove_dir=False)
            self.port = free_port()  # the port was taken in between: pick another
        raise ConfigError(f"redis-server did not start; see {self.workdir / 'redis.log'}")

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(
            self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                return False
            try:
                client = self.client(socket_timeout=0.5)
                try:
                    if client.ping() and client.info("persistence").get("loading", 0) == 0:
                        return True
                finally:
                    client.close()
            except redis.RedisError:
                pass
            time.sleep(0.02)  # polling a child process for readiness, not waiting for time
        return False

    def client(self, **kwargs: Any) -> redis.Redis:
        """A redis-py client of this server (arguments as ``redis.Redis``'s)."""
        return redis.Redis(port=self.port, **kwargs)

    def version(self) -> str:
        client = self.client(socket_timeout=2.0)
        try:
            return str(client.info("server").get("redis_version", "?"))
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the server (no shutdown save, no final fsync beyond the policy)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, *, remove_dir: bool = True) -> None:
        """Terminate the server; a temporary data directory of its own is removed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if remove_dir and self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def restart(self, *, wipe: bool = False) -> None:
        """Kill and start again on the same port; ``wipe`` deletes the data first."""
        self.kill()
        if wipe:
            for entry in self.workdir.iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry)
                elif entry.name != "redis.log":
                    entry.unlink()
        self._spawn()
        if not self._wait_ready(READY_TIMEOUT_S):
            raise ConfigError(f"redis-server did not restart on port {self.port}")

    def pid(self) -> int:
        if self.proc is None:
            raise ConfigError("the redis-server was not started")
        return self.proc.pid

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
