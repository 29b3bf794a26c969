"""What the tests that run the CLI in subprocesses share: a clean environment, running a
command, publishing a request with ``broker-adapter publish``, a row count that tolerates
a database not made yet, polling a condition with a timeout, and the one error line of a
failed command."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

#: The repository's root: where the commands run.
ROOT = Path(__file__).resolve().parents[2]


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment without any ``BA_*`` variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BA_")}
    env.update(extra)
    return env


def run_cli(
    *args: str,
    timeout: float = 60,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], object] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m broker_adapter ARGS`` in ``ROOT``, its output captured; ``env`` defaults
    to ``cli_env()``, ``preexec_fn`` runs in the child before the command (a limit)."""
    return subprocess.run(
        [sys.executable, "-m", "broker_adapter", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or cli_env(),
        preexec_fn=preexec_fn,
    )


def publish(
    redis_url: str,
    keyring: Path | str,
    prefix: str,
    message_id: str,
    payload: object,
    *extra: str,
    principal: str = "alice",
    deadline: float | None = None,
    cli: Callable[..., subprocess.CompletedProcess[str]] = run_cli,
) -> dict[str, Any]:
    """``broker-adapter publish`` of ``payload`` (as JSON) under ``message_id``, with the
    flags ``extra`` (and ``--deadline`` when ``deadline`` is given: a resend must carry the
    first call's); asserts it succeeded and returns the acknowledgement it printed. ``cli``
    runs the command (a test's own ``run_cli`` with a limit)."""
    if deadline is not None:
        extra = (*extra, "--deadline", repr(deadline))
    res = cli(
        "publish",
        "--redis",
        redis_url,
        "--principal",
        principal,
        "--keyring",
        str(keyring),
        "--prefix",
        prefix,
        "--id",
        message_id,
        "--payload",
        json.dumps(payload),
        *extra,
    )
    assert res.returncode == 0, res.stderr
    ack: dict[str, Any] = json.loads(res.stdout)
    assert ack["message_id"] == message_id
    assert ack["submit"].endswith(":submit")  # the adapter picks the entry id
    return ack


def publish_range(
    redis_url: str,
    keyring: Path | str,
    prefix: str,
    ids: Iterable[int],
    *extra: str,
    principal: str = "alice",
    deadline: float | None = None,
    cli: Callable[..., subprocess.CompletedProcess[str]] = run_cli,
) -> None:
    """``publish`` of ``m<i>`` with the payload ``{"i": i}``, for each ``i`` of ``ids``."""
    for i in ids:
        publish(
            redis_url,
            keyring,
            prefix,
            f"m{i}",
            {"i": i},
            *extra,
            principal=principal,
            deadline=deadline,
            cli=cli,
        )


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
