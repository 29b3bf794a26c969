"""What the tests that run the CLI in subprocesses share: a clean environment, a row count
that tolerates a database not made yet, polling a condition with a timeout, and the one
error line of a failed command."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment without any ``BA_*`` variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BA_")}
    env.update(extra)
    return env


def count_rows(db: Path, sql: str) -> int:
    """``sql``'s single number, or 0 while the database or its tables do not exist yet."""
    if not db.exists():
        return 0
    conn = sqlite3.connect(db, timeout=10)
    try:
        return int(conn.execute(sql).fetchone()[0])
    except sqlite3.OperationalError:
        return 0
    finally:
        conn.close()


def wait_for(pred: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
    """Poll ``pred`` until it is true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)  # polling a condition with an explicit timeout
    raise AssertionError(f"timed out waiting for {what}")


def error_line(res: subprocess.CompletedProcess[str], code: int) -> str:
    """The one line a failed command printed on stderr (asserted: exit ``code``, exactly one
    non-empty line, no traceback)."""
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == code, res.stderr
    assert len(lines) == 1, res.stderr
    return lines[0]
