"""Workers killed, frozen and pooled for real: each task ends once, with one reply.

Every worker here is a subprocess (``tests.support.worker_script``). Time moves without
sleeping: a ``drain`` worker runs on a FakeClock fixed at ``--now``, so "after the lease
expired" means the next worker is started with a ``--now`` past it. The handler is
``record_effect``: its ``effects`` table (keyed by the idempotency key) shows how many times
the effect was applied, its ``attempts`` ledger how many times the handler ran.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from broker_adapter.app.pool import WorkerPool
from broker_adapter.clock import FakeClock
from broker_adapter.errors import ConfigError
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.idempotency import idempotency_key_for
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.store import AcceptItem, OutboxStore, TaskStore
from broker_adapter.store.task_types import TaskRow
from tests.support.handlers import effects, init_effects_db, ledger
from tests.support.store_script import open_any

pytestmark = pytest.mark.crash

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_800_000_000.0
LEASE_S = 30.0
AFTER_LEASE = T0 + LEASE_S + 1
EFFECT = "tests.support.handlers:record_effect"
WAIT_S = 30.0


class Setup:
    """A database with tasks accepted at T0, and the effects database their handler uses."""

    def __init__(self, tmp_path: Path, target: str) -> None:
        self.db_path = target  # a SQLite file or a postgresql:// URL
        self.effects_path = tmp_path / "effects.db"
        init_effects_db(self.effects_path)

    def submit(self, n: int = 1, *, now: float = T0) -> list[str]:
        clock = FakeClock(now)
        with open_any(self.db_path) as db:
            items = [
                AcceptItem(
                    "agent-a",
                    Envelope.build(
                        message_id=f"m{i}",
                        sender="agent-a",
                        payload={"effects_db": str(self.effects_path), "value": i},
                        deadline=now + 3600,
                    ),
                )
                for i in range(n)
            ]
            results = TaskStore(db, clock).accept(items)
        ids = [r.task_id for r in results]
        assert all(isinstance(i, str) for i in ids)
        return [str(i) for i in ids]

    def key(self, task_id: str) -> str:
        """The idempotency key the handler sees for ``task_id`` (from its request)."""
        row = self.task(task_id)
        return idempotency_key_for(row.principal, row.message_id)

    def task(self, task_id: str) -> TaskRow:
        with open_any(self.db_path) as db:
            row = TaskStore(db).get(task_id)
        assert row is not None
        return row

    def replies(self) -> dict[str, list[dict[str, Any]]]:
        """Reply bodies by task id."""
        with open_any(self.db_path) as db:
            rows = OutboxStore(db).list(limit=100_000)
        out: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            out.setdefault(str(row.task_id), []).append(json.loads(row.body))
        return out

    def counts(self) -> dict[str, int]:
        with open_any(self.db_path) as db:
            return TaskStore(db).counts()


@pytest.fixture
def setup(tmp_path: Path, store_target: str) -> Setup:
    return Setup(tmp_path, store_target)


def child_env(**points: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("BA_CRASHPOINT", "BA_PAUSEPOINT")}
    env.update(points)
    return env


def script(setup: Setup, mode: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tests.support.worker_script",
        mode,
        "--db",
        str(setup.db_path),
        "--handler",
        EFFECT,
        "--lease-s",
        str(LEASE_S),
        *args,
    ]


def drain(setup: Setup, owner: str, now: float, **points: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        script(setup, "drain", "--owner", owner, "--now", repr(now)),
        cwd=ROOT,
        env=child_env(**points),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )


def stats_of(output: str) -> dict[str, int]:
    (line,) = [x for x in output.splitlines() if x.startswith("STATS ")]
    stats: dict[str, int] = json.loads(line.removeprefix("STATS "))
    return stats


def wait_until(predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    """Wait for a condition a child process brings about (never for time to pass)."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        pause.wait(0.02)


def assert_done_once(setup: Setup, task_id: str, *, fence: int, attempts: int) -> None:
    row = setup.task(task_id)
    assert (row.state, row.fence, row.attempts) == ("done", fence, attempts)
    (reply,) = setup.replies()[task_id]
    assert (reply["status"], reply["fence"], reply["attempts"]) == ("done", fence, attempts)
    assert effects(setup.effects_path) == {setup.key(task_id): 1}


# -- killed -------------------------------------------------------------------------------


def test_worker_killed_after_claim_task_is_reclaimed_and_run_once(setup: Setup) -> None:
    (task_id,) = setup.submit()
    crashed = drain(setup, "w1", T0, BA_CRASHPOINT="worker.after_claim")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    row = setup.task(task_id)
    assert (row.state, row.owner, row.fence, row.attempts) == ("running", "w1", 1, 1)
    assert ledger(setup.effects_path) == []  # the handler never started

    # Still within the lease, nothing is claimable: no second worker may take it.
    early = drain(setup, "w2", T0 + LEASE_S - 1)
    assert early.returncode == 0, early.stderr
    assert stats_of(early.stdout)["claimed"] == 0

    late = drain(setup, "w2", AFTER_LEASE)
    assert late.returncode == 0, late.stderr
    assert stats_of(late.stdout)["done"] == 1
    assert ledger(setup.effects_path) == [(setup.key(task_id), 2, 2, "w2")]
    assert_done_once(setup, task_id, fence=2, attempts=2)


def test_worker_killed_after_effect_rerun_applies_the_effect_once(setup: Setup) -> None:
    (task_id,) = setup.submit()
    crashed = drain(setup, "w1", T0, BA_CRASHPOINT="worker.after_effect")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert setup.task(task_id).state == "running"
    assert setup.replies() == {}
    assert effects(setup.effects_path) == {setup.key(task_id): 1}

    rerun = drain(setup, "w2", AFTER_LEASE)
    assert rerun.returncode == 0, rerun.stderr
    key = setup.key(task_id)
    assert ledger(setup.effects_path) == [(key, 1, 1, "w1"), (key, 2, 2, "w2")]
    assert_done_once(setup, task_id, fence=2, attempts=2)


def test_worker_killed_after_finish_leaves_one_terminal_reply(setup: Setup) -> None:
    (task_id,) = setup.submit()
    crashed = drain(setup, "w1", T0, BA_CRASHPOINT="worker.after_finish")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    again = drain(setup, "w2", AFTER_LEASE)
    assert again.returncode == 0, again.stderr
    assert stats_of(again.stdout)["claimed"] == 0
    assert_done_once(setup, task_id, fence=1, attempts=1)


# -- frozen -------------------------------------------------------------------------------


def test_worker_zombie_commit_is_refused_after_another_worker_finished(setup: Setup) -> None:
    (task_id,) = setup.submit()
    zombie = subprocess.Popen(
        script(setup, "drain", "--owner", "zombie", "--now", repr(T0)),
        cwd=ROOT,
        env=child_env(BA_PAUSEPOINT="worker.after_effect"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        proc = psutil.Process(zombie.pid)
        wait_until(lambda: proc.status() == psutil.STATUS_STOPPED)
        assert effects(setup.effects_path) == {setup.key(task_id): 1}

        rescuer = drain(setup, "w2", AFTER_LEASE)
        assert rescuer.returncode == 0, rescuer.stderr
        assert stats_of(rescuer.stdout)["done"] == 1

        zombie.send_signal(signal.SIGCONT)
        out, err = zombie.communicate(timeout=WAIT_S)
    finally:
        if zombie.poll() is None:
            zombie.kill()
            zombie.communicate(timeout=WAIT_S)
    assert zombie.returncode == 0, err
    stats = stats_of(out)
    assert (stats["stale_commits"], stats["done"], stats["failed"]) == (1, 0, 0)
    assert "stale commit refused" in err
    key = setup.key(task_id)
    assert ledger(setup.effects_path) == [(key, 1, 1, "zombie"), (key, 2, 2, "w2")]
    assert_done_once(setup, task_id, fence=2, attempts=2)


# -- pooled -------------------------------------------------------------------------------


@pytest.fixture
def pools() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for pool in started:
        if pool.poll() is None:
            pool.kill()
            pool.communicate(timeout=WAIT_S)


def first_line(proc: subprocess.Popen[str], timeout_s: float = WAIT_S) -> str:
    """The child's first stdout line, waited for with a timeout."""
    assert proc.stdout is not None
    stdout = proc.stdout
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    assert lines, "no output from the child in time"
    return lines[0]


def start_pool(setup: Setup, pools: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    pool = subprocess.Popen(
        script(setup, "pool", "--workers", "2", "--owner", f"p{len(pools)}"),
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pools.append(pool)
    line = first_line(pool)
    assert line.startswith("READY "), line + (pool.stderr.read() if pool.stderr else "")
    assert len(json.loads(line.removeprefix("READY "))) == 2
    return pool


def stop_pool(pool: subprocess.Popen[str]) -> list[int]:
    pool.send_signal(signal.SIGTERM)
    out, err = pool.communicate(timeout=WAIT_S)
    assert pool.returncode == 0, err
    (line,) = [x for x in out.splitlines() if x.startswith("EXITCODES ")]
    codes: list[int] = json.loads(line.removeprefix("EXITCODES "))
    return codes


def test_worker_pool_processes_each_task_once_and_drains_on_sigterm(
    setup: Setup, pools: list[subprocess.Popen[str]]
) -> None:
    ids = setup.submit(50, now=time.time())  # the pool runs on the real clock

    first = start_pool(setup, pools)
    wait_until(lambda: setup.counts()["done"] >= 10)
    assert stop_pool(first) == [0, 0]  # SIGTERM mid-stream: both children drain cleanly
    assert setup.counts()["running"] == 0  # nothing left half-done

    second = start_pool(setup, pools)
    wait_until(lambda: setup.counts()["done"] == 50)
    assert stop_pool(second) == [0, 0]

    replies = setup.replies()
    assert sorted(replies) == sorted(ids)
    assert all(len(bodies) == 1 and bodies[0]["status"] == "done" for bodies in replies.values())
    assert all(setup.task(i).attempts == 1 for i in ids)  # a clean drain wastes no attempt
    assert effects(setup.effects_path) == {setup.key(i): 1 for i in ids}
    assert len(ledger(setup.effects_path)) == 50  # and no handler ran twice
    owners = {owner for _, _, _, owner in ledger(setup.effects_path)}
    assert owners <= {"p0-0", "p0-1", "p1-0", "p1-1"}


def test_worker_pool_refuses_duplicate_owners(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="owners must be unique"):
        WorkerPool(2, tmp_path / "x.db", EFFECT, lambda i: WorkerConfig(owner="same"))
    with pytest.raises(ConfigError, match="at least one process"):
        WorkerPool(0, tmp_path / "x.db", EFFECT, lambda i: WorkerConfig(owner="w"))


def test_worker_pool_children_die_with_a_sigkilled_parent(
    setup: Setup, pools: list[subprocess.Popen[str]]
) -> None:
    pool = subprocess.Popen(
        script(setup, "pool", "--workers", "2", "--owner", "orphan"),
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pools.append(pool)
    line = first_line(pool)
    children: list[int] = json.loads(line.removeprefix("READY "))
    pool.kill()
    pool.communicate(timeout=WAIT_S)

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie not yet reaped by init still answers kill(0): look at its state
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"

    wait_until(lambda: all(gone(pid) for pid in children))


def test_worker_pool_replaces_a_dead_child(setup: Setup) -> None:
    pool = WorkerPool(
        1, setup.db_path, EFFECT, lambda i: WorkerConfig(owner=f"r{i}", idle_poll_s=0.05)
    )
    pool.start()
    try:
        assert pool.wait_ready(WAIT_S)
        (pid,) = pool.pids
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: pool.alive() == 0)
        assert pool.replace_dead() == 1
        assert pool.restarts == 1
        assert pool.pids != [pid]
        assert pool.wait_ready(WAIT_S)
        ids = setup.submit(5, now=time.time())
        wait_until(lambda: setup.counts()["done"] == 5)
        assert sorted(setup.replies()) == sorted(ids)
    finally:
        assert pool.stop() == [0]
