"""The write gate in front of SQLite's write lock, with real processes.

The gate only orders writers; SQLite's lock still decides. So what must hold is that no
fault of a holder (killed inside its transaction, killed between taking the gate and
naming itself, stopped) leaves the other writers stuck past their busy timeout, and that a
pool's writers really pass through it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.app.pool import WorkerPool
from broker_adapter.clock import FakeClock
from broker_adapter.errors import StoreBusy
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.store import AcceptItem, TaskStore, open_database
from broker_adapter.store.gate import CHECK_S, WriteGate, _alive
from tests.crash.test_worker_crash import wait_until

pytestmark = pytest.mark.crash

CTX = multiprocessing.get_context("spawn")
WAIT_S = 30.0
OK = "tests.support.handlers:ok"


def _hold(gate: WriteGate, db_path: str | None, entered: Any, release: Any) -> None:
    """Child: take the gate (and SQLite's write lock when ``db_path`` is given), say so,
    and leave when told."""
    assert gate.enter(time.monotonic() + WAIT_S)
    conn = None
    if db_path is not None:
        conn = open_database(db_path).conn
        conn.execute("BEGIN IMMEDIATE")
    entered.set()
    release.wait(WAIT_S)
    if conn is not None:
        conn.execute("COMMIT")
    gate.leave()


def _take_unnamed(gate: WriteGate, entered: Any) -> None:
    """Child: take the semaphore and die before writing its pid (the window in ``enter``)."""
    assert gate._sem.acquire(True, WAIT_S)
    entered.set()
    os.kill(os.getpid(), signal.SIGKILL)


def _start(target: Any, *args: Any) -> tuple[Any, Any, Any]:
    entered, release = CTX.Event(), CTX.Event()
    proc = CTX.Process(target=target, args=(*args, entered, release))
    proc.start()
    assert entered.wait(WAIT_S), "the child never took the gate"
    return proc, entered, release


def test_gate_is_exclusive_across_processes_and_free_again_after_leave() -> None:
    gate = WriteGate(CTX)
    proc, _, release = _start(_hold, gate, None)
    try:
        assert gate._holder.value == proc.pid
        assert gate.enter(time.monotonic()) is False  # held: no wait left, no gate
        release.set()
        assert gate.enter(time.monotonic() + WAIT_S) is True
        assert gate._holder.value == os.getpid()
        gate.leave()
        assert gate._holder.value == 0
    finally:
        release.set()
        proc.join(WAIT_S)
    assert proc.exitcode == 0


def test_a_holder_killed_inside_is_released_for_it_by_the_next_writer() -> None:
    gate = WriteGate(CTX)
    proc, _, _ = _start(_hold, gate, None)
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    wait_until(lambda: not _alive(proc.pid))
    assert Path(f"/proc/{proc.pid}").exists()  # not reaped: a zombie counts as dead
    assert gate._holder.value == proc.pid
    started = time.monotonic()
    assert gate.enter(started + WAIT_S) is True
    assert time.monotonic() - started < 10 * CHECK_S + 1.0
    gate.leave()
    proc.join(WAIT_S)
    assert proc.exitcode == -signal.SIGKILL


def test_a_holder_killed_before_naming_itself_is_released_after_two_checks() -> None:
    gate = WriteGate(CTX)
    entered = CTX.Event()
    proc = CTX.Process(target=_take_unnamed, args=(gate, entered))
    proc.start()
    assert entered.wait(WAIT_S)
    proc.join(WAIT_S)
    assert gate._holder.value == 0
    assert gate.enter(time.monotonic()) is False  # the semaphore is still taken
    assert gate.enter(time.monotonic() + WAIT_S) is True
    gate.leave()


def test_leave_after_being_released_for_does_not_free_the_next_holder() -> None:
    gate = WriteGate(CTX)
    assert gate.enter(time.monotonic() + 1)
    gate._release_for(os.getpid())  # as a waiter does when it takes us for dead
    proc, _, release = _start(_hold, gate, None)
    try:
        gate.leave()  # ours was released already: must not release the child's
        assert gate._holder.value == proc.pid
        assert gate.enter(time.monotonic()) is False
    finally:
        release.set()
        proc.join(WAIT_S)
    assert proc.exitcode == 0


def test_a_stopped_holder_gives_store_busy_within_one_busy_timeout(tmp_path: Path) -> None:
    """The gate's wait and SQLite's share one deadline: a holder that keeps both (stopped,
    or just slow) costs the others one busy timeout, then ``StoreBusy``, not two."""
    db_path = tmp_path / "t.db"
    gate = WriteGate(CTX)
    db = open_database(db_path, busy_timeout_ms=400, gate=gate)
    proc, _, release = _start(_hold, gate, str(db_path))
    try:
        started = time.monotonic()
        with pytest.raises(StoreBusy), db.write("claim"):
            pass
        elapsed = time.monotonic() - started
        assert 0.4 <= elapsed < 0.75, elapsed
        release.set()
        proc.join(WAIT_S)
        with db.write("claim") as c:  # free again: the gate and the lock
            c.execute("SELECT 1")
        db.close()
    finally:
        release.set()
        proc.join(WAIT_S)


def test_pool_worker_killed_in_its_commit_does_not_stop_the_other_writers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool worker SIGKILLed inside its finish transaction dies holding the gate; this
    process's writer, on the same gate, takes it over and writes."""
    db_path = tmp_path / "tasks.db"
    clock = FakeClock(time.time())
    db = open_database(db_path)
    TaskStore(db, clock).accept(
        [
            AcceptItem(
                "agent-a",
                Envelope.build(
                    message_id="m1",
                    sender="agent-a",
                    payload={"x": 1},
                    deadline=clock.now() + 3600,
                ),
            )
        ]
    )
    db.close()
    monkeypatch.setenv("BA_CRASHPOINT", "store.finish.before_commit")
    pool = WorkerPool(1, db_path, OK, lambda i: WorkerConfig(owner=f"g{i}"))
    pool.start()
    try:
        assert pool.wait_ready(WAIT_S)
        (pid,) = pool.pids
        wait_until(lambda: pool.alive() == 0)  # it reached its crash point
        assert pool.gate._holder.value == pid  # it died holding the gate
        mine = open_database(db_path, busy_timeout_ms=5_000, gate=pool.gate)
        started = time.monotonic()
        with mine.write("claim") as c:
            row = c.execute("SELECT state FROM tasks WHERE message_id = 'm1'").fetchone()
        assert time.monotonic() - started < 2.0
        assert row[0] == "running"  # its finish was rolled back with the process
        assert pool.gate._holder.value == 0
        mine.close()
    finally:
        monkeypatch.delenv("BA_CRASHPOINT")
        pool.stop()
