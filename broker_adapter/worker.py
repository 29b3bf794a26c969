"""The worker: claims tasks, runs their handlers under a renewed lease, commits each outcome.

Invariants kept (INVARIANTS.md):

* 9: no handler runs inside a SQLite transaction. ``claim``, ``renew``, ``finish`` and
  ``fail`` each run their own short transaction in the store; the handler runs between them
  on a thread of its own, and the lease keeper's renewals are separate transactions too.
* 10: every commit presents the claim's owner and fence. A refused (stale) commit is
  counted (``stale_commits``), logged and dropped; it is never retried or forced.
* 11: cancellation is checked before the handler starts, at every renewal and again just
  before the commit. A cancelled task's outcome is dropped: the store already wrote
  ``cancelled`` and its one reply. An effect the handler already caused stays.

Crash: the worker keeps nothing durable of its own. Killed after the claim
(``worker.after_claim``) or after the handler's effect (``worker.after_effect``), its task
stays ``running`` until the lease expires; the next claim takes it back with attempts+1 and
fence+1, and a handler that keys its external effect by ``Task.idempotency_key`` applies it
once. A worker frozen past its lease wakes up as a zombie whose commit the fence refuses.
Killed after the commit (``worker.after_finish``), the terminal state and its reply are
already durable together.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from functools import partial

from pydantic import BaseModel, ConfigDict, Field

from broker_adapter import crashpoints
from broker_adapter.clock import Clock
from broker_adapter.envelope import canonical_json
from broker_adapter.errors import (
    BrokerAdapterError,
    ConfigError,
    StaleError,
    TaskCancelled,
    TransientError,
)
from broker_adapter.handlers import (
    CallOutcome,
    Handler,
    Task,
    call_handler,
    describe_error,
    is_retryable,
    load_handler,
)
from broker_adapter.store.tasks import ClaimedTask, FailOutcome, TaskStore

DEFAULT_BATCH = 1
DEFAULT_CALL_TIMEOUT_S = 60.0
DEFAULT_IDLE_POLL_S = 0.5
DEFAULT_GRACE_S = 10.0
#: With ``renew_every_s=None`` a lease is renewed this many times per lease period.
RENEWALS_PER_LEASE = 3


class WorkerConfig(BaseModel):
    """One worker's settings.

    Attributes:
        owner: the name written as the lease owner; unique per running worker.
        batch: how many tasks one claim takes.
        call_timeout_s: per handler call; capped by the time left to the task's deadline.
        renew_every_s: lease renewal interval; ``None`` means a third of the store's lease.
        idle_poll_s: how long ``run`` waits when there was nothing to claim.
        grace_s: on stop, how long the running handler may still take.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    owner: str = Field(min_length=1, max_length=128)
    batch: int = Field(default=DEFAULT_BATCH, ge=1, le=1000)
    call_timeout_s: float = Field(default=DEFAULT_CALL_TIMEOUT_S, gt=0)
    renew_every_s: float | None = Field(default=None, gt=0)
    idle_poll_s: float = Field(default=DEFAULT_IDLE_POLL_S, gt=0)
    grace_s: float = Field(default=DEFAULT_GRACE_S, ge=0)


@dataclass
class WorkerStats:
    """Counters of one worker, since it was built.

    Attributes:
        claimed: tasks handed to this worker by ``claim``.
        done: committed ``done``.
        retried: committed a retryable failure (back to ``pending``).
        failed: committed ``failed``.
        stale_commits: commits the store refused (fence, owner, lease, deadline).
        cancelled: tasks found cancelled; nothing committed.
        timeouts: calls abandoned (call timeout, or still running past the stop grace).
        expired: tasks whose deadline passed before their handler could start.
        renewals: successful lease renewals.
        store_errors: commits that failed on a transient store error (left to lease expiry).
    """

    claimed: int = 0
    done: int = 0
    retried: int = 0
    failed: int = 0
    stale_commits: int = 0
    cancelled: int = 0
    timeouts: int = 0
    expired: int = 0
    renewals: int = 0
    store_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class LeaseKeeper:
    """Renews one claimed task's lease on a background thread until stopped.

    A renewal refused as cancelled marks the task cancelled; refused for any other reason
    marks its lease lost. Either way renewing ends, and the handler sees ``cancelled()``.

    Args:
        tasks: the store.
        task: the running task.
        interval_s: seconds between renewals (a real-time wait).
        stats: where ``renewals`` is counted.
        logger: where refusals are reported.
    """

    def __init__(
        self,
        tasks: TaskStore,
        task: Task,
        interval_s: float,
        stats: WorkerStats,
        logger: logging.Logger,
    ) -> None:
        self._tasks = tasks
        self._task = task
        self._interval_s = interval_s
        self._stats = stats
        self._log = logger
        self._lock = threading.Lock()
        self._ended = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start renewing every ``interval_s`` seconds."""
        self._thread = threading.Thread(
            target=self._loop, name=f"lease-{self._task.task_id[:8]}", daemon=True
        )
        self._thread.start()

    def renew_now(self) -> bool:
        """Renew once, now (the background thread calls this; tests may too).

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
                self._task.mark_cancelled()
                self._ended = True
                self._log.info("task %s was cancelled; seen at lease renewal", claimed.task_id)
                return False
            except StaleError as exc:
                self._task.mark_lease_lost(exc)
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
            self._task.note_renewed(lease_until)
            self._stats.renewals += 1
            return True

    def stop(self) -> None:
        """Stop renewing; returns after any renewal in flight has ended."""
        self._stop.set()
        with self._lock:
            self._ended = True
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            if not self.renew_now():
                return


class Worker:
    """Claims tasks from a ``TaskStore`` and runs ``handler`` on each, one at a time.

    Args:
        config: the worker's settings.
        tasks: the store (its ``policy.lease_s`` sets the default renewal interval).
        handler: a callable, or a ``"module:callable"`` spec to load.
        clock: the time source for deadlines; the store's clock by default.
        logger: where to report; ``broker_adapter.worker`` by default.

    Raises:
        ConfigError: the handler spec cannot be loaded, or renewals would come no sooner than
            the lease expires.
    """

    def __init__(
        self,
        config: WorkerConfig,
        tasks: TaskStore,
        handler: Handler | str,
        *,
        clock: Clock | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.config = config
        self.tasks = tasks
        self.handler: Handler = load_handler(handler) if isinstance(handler, str) else handler
        self.clock = clock or tasks.clock
        self.log = logger or logging.getLogger(__name__)
        lease_s = tasks.policy.lease_s
        every = config.renew_every_s
        self.renew_every_s = lease_s / RENEWALS_PER_LEASE if every is None else every
        if self.renew_every_s >= lease_s:
            raise ConfigError(
                f"renew_every_s ({self.renew_every_s} s) must be shorter than the lease "
                f"({lease_s} s), or every lease expires before its renewal"
            )
        self.stats = WorkerStats()
        self._keepers: dict[str, LeaseKeeper] = {}
        self._keepers_lock = threading.Lock()
        self._stop: threading.Event | None = None
        self._drain_until: float | None = None

    @property
    def owner(self) -> str:
        return self.config.owner

    def run_once(self, max_tasks: int | None = None) -> int:
        """Claim one batch and process it: run each handler, commit each outcome.

        Args:
            max_tasks: claim at most this many (and never more than ``config.batch``).

        Returns:
            how many claimed tasks were processed (handled, found cancelled or expired).

        Raises:
            StoreBusy: the claim could not get the write lock; nothing was claimed.
            StoreError: the database failed.
        """
        n = self.config.batch if max_tasks is None else min(self.config.batch, max_tasks)
        if n < 1 or self._stopping():
            return 0
        claimed = self.tasks.claim(self.config.owner, n)
        self.stats.claimed += len(claimed)
        processed = 0
        for index, task in enumerate(claimed):
            # A stop that lands after the claim (a signal during it) still lets the claimed
            # tasks run: they are ours, and leaving them costs an attempt and a lease period.
            # They share one drain deadline, ``grace_s`` after the stop was first seen.
            if self._stopping() and self._drain_deadline() <= time.monotonic():
                # No release in the store yet: these leases expire and the tasks come back.
                self.log.warning(
                    "stopping: %d claimed task(s) not started; they return at lease expiry",
                    len(claimed) - index,
                )
                break
            self._process(task)
            processed += 1
        return processed

    def run(self, stop: threading.Event) -> None:
        """Process tasks until ``stop`` is set.

        When there is nothing to claim it waits on ``stop`` for ``config.idle_poll_s``. Once
        ``stop`` is set it claims nothing more; the running handler (and any task of the
        batch already claimed) gets ``config.grace_s`` from that moment to finish. A handler
        still running then is abandoned and its task handed back as a retryable failure.

        Args:
            stop: set it (e.g. from a SIGTERM handler) to drain and return.

        Raises:
            StoreError: the database failed.
        """
        self._stop = stop
        self._drain_until = None
        try:
            while not stop.is_set():
                try:
                    processed = self.run_once()
                except TransientError as exc:
                    self.log.warning("claim failed, will retry: %s", exc)
                    processed = 0
                if processed == 0:
                    stop.wait(self.config.idle_poll_s)
        finally:
            self._stop = None

    def renew_leases(self) -> int:
        """Renew the lease of every running task now, out of the keeper's schedule.

        Returns:
            how many leases are still held afterwards.
        """
        with self._keepers_lock:
            keepers = list(self._keepers.values())
        return sum(keeper.renew_now() for keeper in keepers)

    # -- one task -------------------------------------------------------------------------

    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def _drain_deadline(self) -> float:
        """The ``time.monotonic()`` instant a stopping worker must be done by (set once)."""
        with self._keepers_lock:
            if self._drain_until is None:
                self._drain_until = time.monotonic() + self.config.grace_s
            return self._drain_until

    def _process(self, claimed: ClaimedTask) -> None:
        crashpoints.hit("worker.after_claim")
        task = Task(
            claimed,
            clock=self.clock,
            cancel_check=partial(self.tasks.is_cancelled, claimed.task_id),
        )
        if task.cancelled():
            self.stats.cancelled += 1
            self.log.info("task %s was cancelled before its handler started", claimed.task_id)
            return
        time_left_s = claimed.deadline - self.clock.now()
        if time_left_s <= 0:
            # Reconcile moves it to ``expired`` with its reply; running it would be refused.
            self.tasks.reconcile()
            self.stats.expired += 1
            self.log.info("task %s reached its deadline before it started", claimed.task_id)
            return
        timeout_s = min(self.config.call_timeout_s, time_left_s)
        keeper = LeaseKeeper(self.tasks, task, self.renew_every_s, self.stats, self.log)
        with self._keepers_lock:
            self._keepers[claimed.task_id] = keeper
        keeper.start()
        try:
            outcome = call_handler(
                self.handler, task, timeout_s, stop=self._stop, drain_deadline=self._drain_deadline
            )
        finally:
            # Stop renewing before the commit: a renewal racing the commit would be refused
            # ("not running") and report a lost lease that was in fact released.
            keeper.stop()
            with self._keepers_lock:
                self._keepers.pop(claimed.task_id, None)
        crashpoints.hit("worker.after_effect")
        if self._commit(task, outcome, timeout_s):
            crashpoints.hit("worker.after_finish")

    def _commit(self, task: Task, outcome: CallOutcome, timeout_s: float) -> bool:
        """Write the outcome (fenced). Returns whether the store accepted a commit."""
        claimed = task.claimed
        # Rule 11: the last check before the commit. The store wrote ``cancelled`` and its
        # reply when cancel() was called; a cancel after this check is refused by finish.
        if task.stop_reason == "cancelled" or self.tasks.is_cancelled(claimed.task_id):
            self._note_cancelled(claimed)
            return False
        try:
            if outcome.ok:
                error = _json_error(outcome)
                if error is None:
                    self.tasks.finish(claimed.task_id, claimed.owner, claimed.fence, outcome.value)
                    self.stats.done += 1
                else:
                    self._fail(claimed, error, retryable=False)
            elif outcome.timed_out:
                self.stats.timeouts += 1
                error = f"TimeoutError: the handler did not return within {timeout_s:.3f} s"
                self._fail(claimed, error, retryable=True)
            elif outcome.stopped:
                self.stats.timeouts += 1
                error = (
                    f"WorkerStopping: the handler did not finish within the "
                    f"{self.config.grace_s} s shutdown grace"
                )
                self._fail(claimed, error, retryable=True)
            else:
                assert outcome.error is not None
                exc = outcome.error
                self._fail(claimed, describe_error(exc), retryable=is_retryable(exc))
        except TaskCancelled:
            self._note_cancelled(claimed)
            return False
        except StaleError as exc:
            self.stats.stale_commits += 1
            self.log.warning(
                "stale commit refused for task %s (owner %s, fence %d): %s",
                claimed.task_id,
                claimed.owner,
                claimed.fence,
                exc,
            )
            return False
        except TransientError as exc:
            self.stats.store_errors += 1
            self.log.warning(
                "commit of task %s failed; the task returns at lease expiry: %s",
                claimed.task_id,
                exc,
            )
            return False
        return True

    def _fail(self, claimed: ClaimedTask, error: str, *, retryable: bool) -> None:
        result = self.tasks.fail(
            claimed.task_id, claimed.owner, claimed.fence, error, retryable=retryable
        )
        if result is FailOutcome.RETRY:
            self.stats.retried += 1
        else:
            self.stats.failed += 1

    def _note_cancelled(self, claimed: ClaimedTask) -> None:
        self.stats.cancelled += 1
        self.log.info(
            "task %s was cancelled while its handler ran; nothing committed "
            "(an effect the handler already caused stays)",
            claimed.task_id,
        )


def _json_error(outcome: CallOutcome) -> str | None:
    """The error text if the handler's value is not JSON, else ``None``."""
    try:
        canonical_json(outcome.value)
    except (TypeError, ValueError, RecursionError) as exc:
        return f"{type(exc).__name__}: the handler returned a non-JSON result: {exc}"
    return None
