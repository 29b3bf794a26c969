"""An adapter subprocess for the client tests (``broker-adapter run`` on a test
redis-server), started and stopped with SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.cli import cli_env, count_rows, wait_for

ROOT = Path(__file__).resolve().parents[2]
HANDLER = "tests.support.client_handlers:by_payload"


@contextmanager
def running_adapter(
    redis_url: str, db: Path, keyring: Path, prefix: str, *extra: str, workers: int = 2
) -> Iterator[subprocess.Popen[str]]:
    """``broker-adapter run`` with the client tests' handler until the block ends; the
    block starts once the database exists (the adapter is reading)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "run",
            "--redis",
            redis_url,
            "--db",
            str(db),
            "--handler",
            HANDLER,
            "--workers",
            str(workers),
            "--keyring",
            str(keyring),
            "--prefix",
            prefix,
            "--lease",
            "5",
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(),
    )
    try:
        wait_for(lambda: count_rows(db, "SELECT count(*) FROM sqlite_master") > 0, "database")
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout:
            proc.stdout.close()
