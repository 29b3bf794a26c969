"""A real ``broker-adapter run`` process for a test: started on a Redis URL with a database
of its own, ready once its ingest group exists, stopped with SIGTERM (then SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from broker_adapter.errors import ConfigError
from broker_adapter.protocol.keys import INGEST_GROUP, Keys
from broker_adapter.redis.client import connect
from broker_adapter.redis.probe import sample_groups

ADAPTER_READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0


class RunningAdapter:
    """``broker-adapter run`` in a subprocess.

    Args:
        redis_url: the Redis holding the streams.
        db: the adapter's database (a SQLite file path, or a ``postgresql://`` URL).
        keyring: the keyring file (mode 0600).
        prefix: the stream prefix.
        target: ``("--handler", "mod:func")`` or ``("--app", "mod:router")``: what it serves.
        app_dir: the directory the handler's module is imported from.
        extra_args: more ``run`` flags, e.g. ``["--workers", "1"]``.
        log_path: where its stderr goes (default: beside a SQLite database).
    """

    def __init__(
        self,
        *,
        redis_url: str,
        db: str | Path,
        keyring: str | Path,
        prefix: str,
        target: tuple[str, str],
        app_dir: str | Path = ".",
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.prefix = prefix
        self.args = [
            sys.executable,
            "-m",
            "broker_adapter",
            "run",
            "--redis",
            redis_url,
            "--db",
            str(db),
            "--keyring",
            str(keyring),
            "--prefix",
            prefix,
            target[0],
            target[1],
            "--app-dir",
            str(app_dir),
            *extra_args,
        ]
        default_log = Path(str(db) + ".log") if "://" not in str(db) else Path("adapter.log")
        self.log_path = log_path or default_log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = ADAPTER_READY_TIMEOUT_S) -> RunningAdapter:
        """Start it and wait until its ingest group exists on the inbound stream.

        Raises:
            ConfigError: it exited, or was not ready within ``timeout_s`` (its log says why).
        """
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=log, env=dict(os.environ))
        client = connect(self.redis_url, socket_timeout_s=2.0, connect_timeout_s=2.0)
        stream = Keys(self.prefix).inbound()
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ConfigError(
                        f"broker-adapter run exited {self.proc.returncode}: see {self.log_path}"
                    )
                if any(g[1] == INGEST_GROUP for g in sample_groups(client, [stream]).groups):
                    return self
                time.sleep(0.05)  # polling a child process for readiness
        finally:
            client.close()
        self.stop()
        raise ConfigError(f"broker-adapter run was not ready in {timeout_s} s: see {self.log_path}")

    def kill(self) -> None:
        """SIGKILL it (a crash: nothing drains)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> int | None:
        """SIGTERM it (it drains and stops), SIGKILL after ``STOP_TIMEOUT_S``; its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        return self.proc.returncode

    def log(self) -> str:
        """What it wrote on stderr so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def __enter__(self) -> RunningAdapter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
