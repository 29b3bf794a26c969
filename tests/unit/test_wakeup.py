"""The wake-up path between the ingest and idle worker processes."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from broker_adapter.clock import FakeClock
from broker_adapter.envelope import Envelope
from broker_adapter.handlers import Task
from broker_adapter.pool import WakeUp
from broker_adapter.runner import NotifyingTaskStore
from broker_adapter.store import AcceptItem, TaskStore, open_database
from broker_adapter.worker import Worker, WorkerConfig


def _item(i: int, clock: FakeClock) -> AcceptItem:
    return AcceptItem(
        "alice",
        Envelope.build(
            message_id=f"m{i}", sender="alice", payload={"i": i}, deadline=clock.now() + 60
        ),
    )


def test_wakeup_keeps_at_most_one_permit_per_worker() -> None:
    wake = WakeUp(2)
    assert wake.wait(0) is False
    wake.notify(1)
    assert wake.wait(0) is True
    assert wake.wait(0) is False
    wake.notify(5)  # five tasks, two workers: two wake-ups
    wake.notify(1)  # nobody took them yet: no third
    assert [wake.wait(0) for _ in range(3)] == [True, True, False]


def test_ingest_store_notifies_the_new_tasks_only(tmp_path: Path, clock: FakeClock) -> None:
    notified: list[int] = []
    with open_database(tmp_path / "t.db") as db:
        store = NotifyingTaskStore(db, clock, notify=notified.append)
        store.accept([_item(0, clock), _item(1, clock)])
        store.accept([_item(1, clock)])  # a duplicate: nothing new to wake anyone for
        store.accept([_item(2, clock)])
    assert notified == [2, 1]


def _run_idle_worker(
    tasks: TaskStore, clock: FakeClock, script: list[str]
) -> tuple[list[int], list[float]]:
    """Run a worker whose idle waits follow ``script``: ``"work"`` commits a task and ends
    the wait on the signal, ``"timeout"`` ends it with nothing announced; after the script
    the worker is stopped. Returns what the handler saw and the waits' timeouts."""
    stop = threading.Event()
    waits: list[float] = []
    handled: list[int] = []

    def wake(timeout_s: float) -> bool:
        waits.append(timeout_s)
        if len(waits) > len(script):
            stop.set()
            return False
        if script[len(waits) - 1] == "work":
            tasks.accept([_item(len(waits), clock)])
            return True
        return False

    def handler(task: Task) -> dict[str, Any]:
        handled.append(task.payload["i"])
        return {}

    config = WorkerConfig(owner="w1", idle_poll_s=0.25, wake_poll_s=0.001)
    Worker(config, tasks, handler, wake=wake).run(stop)
    return handled, waits


def test_idle_worker_waits_on_the_wakeup_instead_of_polling(
    tmp_path: Path, clock: FakeClock
) -> None:
    with open_database(tmp_path / "t.db") as db:
        handled, waits = _run_idle_worker(TaskStore(db, clock), clock, ["work"])
    assert handled == [1]
    assert waits == [0.25, 0.25]  # the poll interval is only the fallback timeout


class _CountingStore(TaskStore):
    """A TaskStore that counts its looks (``has_work``) and claims."""

    looks = 0
    claims = 0

    def has_work(self) -> bool:
        self.looks += 1
        return super().has_work()

    def claim(self, owner: str, n: int = 1) -> list[Any]:
        self.claims += 1
        return super().claim(owner, n)


def test_woken_worker_claims_without_looking_first(tmp_path: Path, clock: FakeClock) -> None:
    """The signal says tasks were committed: the look (a read) before the claim would only
    repeat it. A wait that times out still looks before it claims."""
    with open_database(tmp_path / "t.db") as db:
        tasks = _CountingStore(db, clock)
        handled, _ = _run_idle_worker(tasks, clock, ["work", "timeout"])
    assert handled == [1]
    # the first claim of run() (nothing yet), then the one straight after the signal
    assert tasks.claims == 2
    assert tasks.looks == 1  # only after the wait that timed out
