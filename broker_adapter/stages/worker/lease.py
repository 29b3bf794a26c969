"""Lease keeping: every claimed task's lease renewed from its claim until its commit.

A worker holds a lease for every task it claimed, started or not, until the task's outcome
is committed (``docs/RULES.md`` rule 10): a task waiting its turn in a batch, or an outcome
waiting for the batch's commit, must not lose its lease and run twice. One ``LeaseRenewer``
thread per worker renews all of them when due; each renewal is its own short store
transaction (``LeaseKeeper.renew_now``), never inside another one (rule 9). A renewal
refused as cancelled, or as stale, tells the task (``task.TaskControl``), whose handler then
sees ``cancelled()`` (rule 11).
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import Protocol

from broker_adapter.clock import Clock
from broker_adapter.errors import (
    BrokerAdapterError,
    ConfigError,
    StaleError,
    TaskCancelled,
    TransientError,
)
from broker_adapter.handler.task import Task, TaskControl
from broker_adapter.store.task_types import ClaimedTask
from broker_adapter.store.tasks import TaskStore

#: With ``renew_every_s=None`` a lease is renewed this many times per lease period.
RENEWALS_PER_LEASE = 3


def renew_interval(lease_s: float, every_s: float | None) -> float:
    """The renewal interval: ``every_s``, or ``lease_s / RENEWALS_PER_LEASE`` for ``None``.

    Raises:
        ConfigError: renewals would come no sooner than the lease expires.
    """
    interval_s = lease_s / RENEWALS_PER_LEASE if every_s is None else every_s
    if interval_s >= lease_s:
        raise ConfigError(
            f"renew_every_s ({interval_s} s) must be shorter than the lease "
            f"({lease_s} s), or every lease expires before its renewal"
        )
    return interval_s


class RenewalCount(Protocol):
    """Where a keeper counts its successful renewals (``worker.WorkerStats``)."""

    renewals: int


class LeaseRenewer:
    """One thread that renews the leases of all of a worker's claimed tasks when due.

    A worker holds a lease for every task it claimed, started or not, until the task's
    outcome is committed; one thread for all of them costs nothing per task. Each renewal
    is its own short transaction (``LeaseKeeper.renew_now``), never inside another one.
    The thread starts with the first lease and ends after a second with none.
    """

    IDLE_EXIT_S = 1.0

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._due: dict[LeaseKeeper, float] = {}
        self._thread: threading.Thread | None = None
        self._wakes_at = float("inf")  # when the thread's current wait ends

    def add(self, keeper: LeaseKeeper) -> None:
        with self._cond:
            due = time.monotonic() + keeper.interval_s
            self._due[keeper] = due
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"renew-{self._name}", daemon=True
                )
                self._thread.start()
            elif due < self._wakes_at:  # rarely: a wake-up per claimed task costs a switch
                self._cond.notify()

    def remove(self, keeper: LeaseKeeper) -> None:
        with self._cond:
            self._due.pop(keeper, None)

    def _next(self) -> list[LeaseKeeper] | None:
        """The keepers due now (rescheduled); ``None`` when the thread should end."""
        with self._cond:
            while True:
                now = time.monotonic()
                if not self._due:
                    self._wakes_at = now + self.IDLE_EXIT_S
                    self._cond.wait(self.IDLE_EXIT_S)
                    if not self._due:
                        self._thread = None
                        return None
                    continue
                due = [k for k, at in self._due.items() if at <= now]
                if due:
                    self._wakes_at = float("inf")
                    for keeper in due:
                        self._due[keeper] = now + keeper.interval_s
                    return due
                self._wakes_at = min(self._due.values())
                self._cond.wait(self._wakes_at - now)

    def _loop(self) -> None:
        while (due := self._next()) is not None:
            for keeper in due:  # outside the lock: each renewal is a store transaction
                if not keeper.renew_now():
                    self.remove(keeper)


class LeaseKeeper:
    """Keeps one claimed task's lease renewed every ``interval_s`` until stopped.

    A renewal refused as cancelled marks the task cancelled; refused for any other reason
    marks its lease lost. Either way renewing ends, and the handler sees ``cancelled()``.

    Args:
        tasks: the store.
        task: the claimed task.
        interval_s: seconds between renewals (a real-time wait).
        stats: where ``renewals`` is counted.
        logger: where refusals are reported.
        renewer: the worker's shared renewal thread; without one the keeper runs a thread
            of its own.
    """

    def __init__(
        self,
        tasks: TaskStore,
        task: Task,
        interval_s: float,
        stats: RenewalCount,
        logger: logging.Logger,
        renewer: LeaseRenewer | None = None,
    ) -> None:
        self._tasks = tasks
        self._task = task
        self._control = TaskControl(task)
        self.interval_s = interval_s
        self._stats = stats
        self._log = logger
        self._renewer = renewer
        self._lock = threading.Lock()
        self._ended = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start renewing every ``interval_s`` seconds."""
        if self._renewer is not None:
            self._renewer.add(self)
            return
        self._thread = threading.Thread(
            target=self._loop, name=f"lease-{self._task.task_id[-8:]}", daemon=True
        )
        self._thread.start()

    def renew_now(self) -> bool:
        """Renew once, now (the renewal thread calls this; tests may too).

        Returns:
            True while the lease is held (a transient store error counts as held: the next
            renewal tries again), False once it is lost, cancelled or the keeper stopped.
        """
        with self._lock:
            if self._ended:
                return False
            claimed = self._task.claimed
            try:
                lease_until = self._tasks.renew(claimed.task_id, claimed.owner, claimed.fence)
            except TaskCancelled:
                self._control.mark_cancelled()
                self._ended = True
                self._log.info("task %s was cancelled; seen at lease renewal", claimed.task_id)
                return False
            except StaleError as exc:
                self._control.mark_lease_lost(exc)
                self._ended = True
                self._log.warning("lease lost on task %s: %s", claimed.task_id, exc)
                return False
            except TransientError as exc:
                self._log.warning("renewal of task %s failed, will retry: %s", claimed.task_id, exc)
                return True
            except BrokerAdapterError:
                self._ended = True
                self._log.exception("renewal of task %s failed; renewing stops", claimed.task_id)
                return False
            self._control.note_renewed(lease_until)
            self._stats.renewals += 1
            return True

    def stop(self) -> None:
        """Stop renewing; returns after any renewal in flight has ended."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.remove(self)
        with self._lock:
            self._ended = True
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.renew_now():
                return


class Leases:
    """The leases of all of one worker's claimed tasks, each kept from its claim (``keep``)
    until its commit (``release``), renewed by one shared ``LeaseRenewer`` thread.

    Args:
        tasks: the store.
        owner: the worker (names the renewal thread).
        interval_s: seconds between renewals (``renew_interval``).
        clock: the time source of the tasks' ``time_left_s``.
        stats: where ``renewals`` is counted.
        logger: where refusals are reported.
    """

    def __init__(
        self,
        tasks: TaskStore,
        owner: str,
        interval_s: float,
        clock: Clock,
        stats: RenewalCount,
        logger: logging.Logger,
    ) -> None:
        self._tasks = tasks
        self._interval_s = interval_s
        self._clock = clock
        self._stats = stats
        self._log = logger
        self._keepers: dict[str, LeaseKeeper] = {}
        self._lock = threading.Lock()
        self._renewer = LeaseRenewer(owner)

    def keep(self, claimed: ClaimedTask) -> Task:
        """The handler's view of a claimed task, with its lease kept from now on."""
        task = Task(claimed, clock=self._clock, cancel_check=partial(self._still_held, claimed))
        keeper = LeaseKeeper(
            self._tasks, task, self._interval_s, self._stats, self._log, self._renewer
        )
        with self._lock:
            self._keepers[claimed.task_id] = keeper
        keeper.start()
        return task

    def _still_held(self, claimed: ClaimedTask) -> bool | StaleError:
        """``Task.cancelled()``'s look at the store (``TaskStore.refusal``): True when the
        task was cancelled, the refusal when this worker no longer holds it (fence, owner,
        lease), False while it does. A claim that moved on while this worker was frozen is
        seen before its handler starts, not only at the next renewal. (Takes the claim, not
        the ``Task``: no reference cycle per task for the garbage collector to find.)"""
        refusal = self._tasks.refusal(claimed.task_id, claimed.owner, claimed.fence)
        if isinstance(refusal, TaskCancelled):
            return True
        return refusal if refusal is not None else False

    def release(self, task_id: str) -> None:
        """Stop renewing ``task_id``; returns after a renewal in flight has ended."""
        with self._lock:
            keeper = self._keepers.pop(task_id, None)
        if keeper is not None:
            keeper.stop()

    def renew_all(self) -> int:
        """Renew every kept lease now, out of the schedule; returns how many are still held."""
        with self._lock:
            keepers = list(self._keepers.values())
        return sum(keeper.renew_now() for keeper in keepers)
