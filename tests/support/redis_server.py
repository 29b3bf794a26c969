"""A private redis-server for tests: free loopback port, own temp dir, killable, restartable.

Never touches the machine's shared Redis on 6379.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

REDIS_BINARY = "redis-server"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def binary_available() -> bool:
    return shutil.which(REDIS_BINARY) is not None


class RedisServer:
    """One redis-server process.

    Args:
        workdir: its data directory (AOF lives here, so restarts keep data).
        appendfsync: ``always`` (default), ``everysec`` or ``no``; ``None`` disables AOF.
    """

    def __init__(self, workdir: Path, appendfsync: str | None = "always") -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.appendfsync = appendfsync
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        args = [
            REDIS_BINARY,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.workdir / "redis.log"),
            "--enable-debug-command", "local",
            "--aof-load-truncated", "yes",
        ]  # fmt: skip
        if self.appendfsync is None:
            args += ["--appendonly", "no"]
        else:
            args += ["--appendonly", "yes", "--appendfsync", self.appendfsync]
        return args

    def start(self, timeout_s: float = 10.0) -> None:
        for _ in range(5):
            self.proc = subprocess.Popen(
                self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            if self._wait_ready(timeout_s):
                return
            self.stop()
            self.port = free_port()  # the port was taken in between: pick another
        raise RuntimeError(f"redis-server did not start; see {self.workdir / 'redis.log'}")

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

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(port=self.port, **kwargs)  # type: ignore[arg-type]

    def kill(self) -> None:
        """SIGKILL the server (no shutdown save, no final fsync beyond the policy)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def restart(self, *, wipe: bool = False) -> None:
        """Kill and start again on the same port; ``wipe`` deletes the data dir first."""
        self.kill()
        if wipe:
            for entry in self.workdir.iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry)
                elif entry.name != "redis.log":
                    entry.unlink()
        port = self.port
        self.proc = subprocess.Popen(
            self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        if not self._wait_ready(10.0):
            raise RuntimeError(f"redis-server did not restart on port {port}")

    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def require_binary() -> None:
    """Skip locally, fail in CI, when redis-server is missing."""
    import pytest

    if binary_available():
        return
    if os.environ.get("CI"):
        pytest.fail("redis-server is not installed; .ci/run should have installed it")
    pytest.skip("redis-server binary not found")
