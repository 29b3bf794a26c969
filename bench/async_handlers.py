"""The async-handler phase of ``make bench`` (``--only async``): every handler waits 50 ms
(``async_app.nap``: an ``await``, as on a model or an API), ``--concurrency`` of them at a
time in each of ``--workers`` worker processes; and taskiq on the same workload.

Ours: ``broker-adapter run --app async_app:router --app-dir bench --workers W
--concurrency C`` (a real subprocess), one agent publishing ``n`` signed envelopes,
pipelined. Rate = n / (the last task's ``finished_at`` - the first publish), read from the
adapter's database once every task is done and its reply sent; each task must be done at
its first attempt.

taskiq: ``bench/peers/taskiq_bench.py --task nap --max-async-tasks C`` in
``bench/.venv-peers`` (taskiq + taskiq-redis ``RedisStreamBroker``, ``--workers W``), against
the same private redis-server, timed the same way (first publish to the last task's end).
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common
from common import ROOT

HERE = Path(__file__).resolve().parent


def _one(db: Path, sql: str, params: tuple[Any, ...] = ()) -> Any:
    if not db.exists():
        return None
    conn = sqlite3.connect(db, timeout=10)
    try:
        return conn.execute(sql, params).fetchone()
    except sqlite3.OperationalError:
        return None
    finally:
        conn.close()


def _wait_done(db: Path, tag: str, n: int, timeout_s: float, runner: subprocess.Popen[Any]) -> None:
    deadline = time.monotonic() + timeout_s
    sql = ("SELECT count(*) FROM tasks t JOIN outbox o ON o.task_id = t.task_id"
           " WHERE t.message_id LIKE ? AND t.state = 'done' AND o.state = 'sent'")  # fmt: skip
    while True:
        row = _one(db, sql, (f"{tag}-%",))
        if row is not None and row[0] >= n:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {row[0] if row else 0}/{n} async tasks done in time")
        if runner.poll() is not None:
            raise RuntimeError(f"the adapter exited ({runner.returncode})")
        time.sleep(0.05)  # polling the adapter's database, with a deadline


def _publish(url: str, prefix: str, count: int, tag: str) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, str(HERE / "run.py"), "_publish", "--redis", url, "--prefix", prefix,
         "--count", str(count), "--tag", tag],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=common.python_env(),
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"publishing failed: {proc.stderr[-1500:]}")
    sent: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return sent


def adapter_run(
    url: str, workdir: Path, keyring: Path, n: int, workers: int, concurrency: int
) -> dict[str, Any]:
    """One run of ours (see the module); raises if any task is not done once."""
    prefix = common.new_prefix()
    db, log = workdir / f"{prefix}.db", workdir / f"{prefix}.log"
    with log.open("w") as out:
        runner = subprocess.Popen(
            [sys.executable, "-m", "broker_adapter", "run", "--redis", url, "--db", str(db),
             "--app", "async_app:router", "--app-dir", str(HERE), "--workers", str(workers),
             "--concurrency", str(concurrency), "--keyring", str(keyring), "--prefix", prefix,
             "--name", "bench-async"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=common.python_env(),
        )  # fmt: skip
    try:
        _publish(url, prefix, 200, "w")
        _wait_done(db, "w", 200, 120, runner)
        sent = _publish(url, prefix, n, "a")
        _wait_done(db, "a", n, max(120.0, n / 20), runner)
    finally:
        code = common.terminate(runner, 60)
    last, attempts, done = _one(
        db, "SELECT max(finished_at), max(attempts), count(*) FROM tasks"
        " WHERE message_id LIKE 'a-%' AND state = 'done'",
    )  # fmt: skip
    if done != n or attempts != 1 or code != 0:
        raise RuntimeError(f"async run went wrong: done {done}/{n}, attempts {attempts},"
                           f" exit {code}; see {log}")  # fmt: skip
    seconds = float(last) - sent["start"]
    return {"rate": n / seconds, "seconds": seconds, "n": n, "workers": workers,
            "concurrency": concurrency, "ideal_rate": workers * concurrency / 0.05}  # fmt: skip


def taskiq_run(
    py: Path, url: str, n: int, reps: int, workers: int, concurrency: int
) -> dict[str, Any]:
    """taskiq on the same workload (see the module), or ``{"error": ...}``."""
    proc = subprocess.run(
        [str(py), str(HERE / "peers" / "taskiq_bench.py"), "--redis", url, "--n", str(n),
         "--reps", str(reps), "--workers", str(workers), "--task", "nap",
         "--max-async-tasks", str(concurrency)],
        cwd=HERE / "peers", capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip()[-1500:]
        return {"error": f"taskiq async bench failed (exit {proc.returncode}): {tail}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result
