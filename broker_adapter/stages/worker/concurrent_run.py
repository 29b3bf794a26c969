"""Several handler calls of one batch at once: ``ConcurrentRun`` spreads a batch over
``slots`` call runs (``calls.CallRun``), each on a call thread of its own, and looks like one
``CallRun`` to the worker that supervises and commits them.

Each call keeps what a call of a one-at-a-time worker has: its task's own lease (the
worker's ``lease.Leases`` renews every claimed task's), fence, call timeout (each run
supervises its own call) and cancel check; a lease lost by one task stops only that task.
An async handler's call waits on the process's one event loop (``calls.process_loop``),
so ``slots`` async calls wait there together; a sync handler's call runs on its slot's
thread.

Tasks are dealt to the slots in turn when the batch starts (task ``i`` to slot
``i % slots``): a slot runs its share back to back, so a batch's slowest share decides when
the batch ends and its outcomes commit (earlier ones commit as ``batch_window_s`` passes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from broker_adapter.handler.task import Task
from broker_adapter.stages.shared.calls import CallRun, RunOutcome
from broker_adapter.stages.shared.handlers import Handler


class ConcurrentRun:
    """``CallRun``'s interface over ``slots`` runs of one batch (see the module).

    Args:
        handler: the handler.
        tasks: the batch, in claim order.
        prepare: as ``CallRun``'s, called on each slot's thread.
        after: as ``CallRun``'s.
        slots: how many calls at once, at most (fewer when the batch is smaller).
    """

    def __init__(
        self,
        handler: Handler,
        tasks: list[Task],
        prepare: Callable[[Task], float | None],
        after: Callable[[], None] | None = None,
        slots: int = 1,
    ) -> None:
        n = max(1, min(slots, len(tasks)))
        self._runs = [
            CallRun(handler, tasks[slot::n], prepare, after, slot=slot) for slot in range(n)
        ]
        self._error: BaseException | None = None

    @property
    def started(self) -> int:
        return sum(r.started for r in self._runs)

    @property
    def not_started(self) -> int:
        return sum(r.not_started for r in self._runs)

    def wait(self, timeout_s: float) -> bool:
        """Wait until every slot's run has ended, ``timeout_s`` at most in all."""
        deadline = time.monotonic() + timeout_s
        return all(run.wait(max(0.0, deadline - time.monotonic())) for run in self._runs)

    def take(self) -> list[RunOutcome]:
        """The outcomes recorded since the last ``take``, of every slot, in the order they
        ended.

        Raises:
            BaseException: what a ``prepare`` raised (``CallRun.take``), once the outcomes
                recorded before it were taken.
        """
        out: list[RunOutcome] = []
        for run in self._runs:
            try:
                out.extend(run.take())
            except BaseException as exc:  # noqa: BLE001 - raised once the outcomes are taken
                self._error = self._error or exc
        if not out and self._error is not None:
            error, self._error = self._error, None
            raise error
        return sorted(out, key=lambda o: o.ended_at)

    def halt(self) -> None:
        for run in self._runs:
            run.halt()

    def supervise(
        self,
        stop: threading.Event | None = None,
        *,
        grace_s: float = 0.0,
        drain_deadline: Callable[[], float] | None = None,
    ) -> float:
        """Supervise the call of every slot still running (``CallRun.supervise``); the
        shortest wait among them (0 when none runs)."""
        waits = [
            r.supervise(stop, grace_s=grace_s, drain_deadline=drain_deadline)
            for r in self._runs
            if not r.wait(0)
        ]
        return min(waits, default=0.0)
