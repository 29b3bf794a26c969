"""The worker: claims tasks, runs their handlers under a renewed lease, commits each outcome.

Invariants kept (``docs/RULES.md``):

* 9: no handler runs inside a SQLite transaction. ``claim``, ``renew``, ``finish`` and
  ``fail`` each run their own short transaction in the store; the handler runs between them
  on a thread of its own, and the lease keeper's renewals are separate transactions too.
* 10: every commit presents the claim's owner and fence. A refused (stale) commit is
  counted (``stale_commits``), logged and dropped; it is never retried or forced.
* 11: cancellation is checked before the handler starts, at every renewal and again just
  before the commit. A cancelled task's outcome is dropped: the store already wrote
  ``cancelled`` and its one reply. An effect the handler already caused stays. The check
  before the start (``TaskStore.refusal``) also finds a claim that moved on (fence, owner,
  lease): a worker frozen past its lease does not start the rest of its batch.

Batches: a claim takes up to ``WorkerConfig.batch`` tasks in one transaction, sized by the
running average of handler times so that a batch takes about ``batch_window_s`` (slow
handlers: one at a time). The handlers run one after another, outside any transaction, back
to back on one call thread (``handlers.CallRun``) while the worker's thread supervises their
timeouts; their outcomes commit together in one transaction (``TaskStore.settle_batch``:
each outcome fenced on its own), at the end of the batch or once the oldest is
``batch_window_s`` old, and in ``run`` that transaction also claims the next batch. Every
claimed task's lease is renewed (one ``LeaseRenewer`` thread per worker) from its claim
until its commit, so a task waiting its turn, or an outcome waiting for its batch, never
loses its lease and runs twice.
When idle, ``run`` waits on its hand-off from the ingest (``handoff.HandoffEndpoint``: tasks
the ingest's accept transaction claimed for it, or a signal to look or claim) or, without
one, looks for work with a read (``TaskStore.has_work``) every ``wake_poll_s`` for a second
after its last work, then less and less often, up to ``idle_poll_s``.

Replies (with ``WorkerConfig.redis_url``): the batch's commit writes each terminal reply
already claimed by the worker's publisher identity (rules 13, 14 of ``docs/RULES.md``: state
and reply in one transaction; the publisher has its own claim, lease and fence), and the
worker publishes them right after the commit with the dispatcher's ``ReplyPublisher``. The
confirmed ones are marked sent (fenced) by the next batch's commit when it follows soon,
else by a small transaction of their own. A kill between the commit and the mark leaves rows
``sending`` that the dispatcher takes back after the publisher lease (its script finds what
was already published); a Redis failure puts them back in line with backoff.

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
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from broker_adapter import crashpoints
from broker_adapter.clock import Clock
from broker_adapter.config import ConfigModel, KeyPrefix
from broker_adapter.errors import (
    BrokerAdapterError,
    ConfigError,
    EnvelopeError,
    RetryableError,
    StaleError,
    TaskCancelled,
    TransientError,
)
from broker_adapter.protocol.envelope import check_result
from broker_adapter.protocol.keys import DEFAULT_PREFIX, Keys
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.streams import RedisUrl, connect
from broker_adapter.stages.dispatcher import (
    DEFAULT_RECORD_TTL_S,
    DispatcherStats,
    Publication,
    ReplyPublisher,
)
from broker_adapter.stages.handlers import (
    CallOutcome,
    CallRun,
    Handler,
    RunOutcome,
    StopRun,
    Task,
    describe_error,
    is_retryable,
    load_handler,
)
from broker_adapter.stages.handoff import CLAIM, Handed, IdleWait
from broker_adapter.store import transitions
from broker_adapter.store.outbox import OutboxPolicy, OutboxRow, OutboxStore, SentMark
from broker_adapter.store.tasks import (
    ClaimedTask,
    FailOutcome,
    SettledBatch,
    Settlement,
    TaskStore,
)

if TYPE_CHECKING:
    import redis

    from broker_adapter.app.metrics import WorkerMetrics

DEFAULT_BATCH = 128
DEFAULT_BATCH_WINDOW_S = 0.05
DEFAULT_CALL_TIMEOUT_S = 60.0
DEFAULT_IDLE_POLL_S = 0.05
DEFAULT_WAKE_POLL_S = 0.001
DEFAULT_GRACE_S = 10.0
#: With ``renew_every_s=None`` a lease is renewed this many times per lease period.
RENEWALS_PER_LEASE = 3
#: The first claim of a worker takes at most this many tasks (no handler time known yet).
INITIAL_CLAIM = 4
#: An idle worker keeps looking every ``wake_poll_s`` this long after its last work, then
#: backs off towards ``idle_poll_s``.
ALERT_AFTER_WORK_S = 1.0
#: Weight of the newest handler time in the running average that sizes claims.
HANDLER_TIME_WEIGHT = 0.2
#: After Redis failed a worker's publication, its replies go to the dispatcher this long.
PUBLISH_PAUSE_S = 1.0
#: The error a task fails with when its handler's result is over the result bounds
#: (``envelope.check_result``); not retried: the handler would return as much again.
RESULT_TOO_LARGE = "result_too_large"


class WorkerConfig(ConfigModel):
    """One worker's settings.

    Attributes:
        owner: the name written as the lease owner; unique per running worker.
        batch: the most tasks one claim takes (one transaction). Claims are sized so that
            a batch's handlers take about ``batch_window_s`` (from the running average of
            this worker's handler times): fast handlers are claimed ``batch`` at a time,
            handlers slower than the window one at a time. The first claim takes at most
            ``INITIAL_CLAIM``. Every claimed task's lease is renewed until its commit.
        batch_window_s: how long a batch may keep outcomes before committing them. The
            outcomes of a batch commit together (one transaction, one fsync) after its
            last handler, or before the next handler starts once the oldest uncommitted
            outcome is this old, seconds.
        call_timeout_s: per handler call; capped by the time left to the task's deadline.
        renew_every_s: lease renewal interval; ``None`` means a third of the store's lease.
        idle_poll_s: the longest pause between two looks for work when idle, seconds. A
            look is a read (``TaskStore.has_work``: no write lock, no fsync); a claim
            follows only when it finds something.
        wake_poll_s: the pause between looks for ``ALERT_AFTER_WORK_S`` after the last
            work, seconds; after that it doubles with every empty look, up to
            ``idle_poll_s``.
        grace_s: on stop, how long the running handler may still take.
        redis_url: the Redis of the reply streams. With it the worker publishes the replies
            of its own batches right after their commit (see ``Worker``); without it (or
            ``None``) they wait in the outbox for the dispatcher.
        prefix: the key prefix (see ``keys``), as the dispatcher's.
        record_ttl_s: how long its publication records live (the dispatcher's
            ``DispatcherConfig.record_window_s``).
        metrics_dir: with it, the worker's counters and handler times go to
            prometheus-client's multiprocess files there (``metrics.WorkerMetrics``);
            ``None`` (default): no metrics, nothing imported.
        handler_name: the ``handler`` label of its handler duration histogram.
    """

    owner: str = Field(min_length=1, max_length=128)
    batch: int = Field(default=DEFAULT_BATCH, ge=1, le=1000)
    batch_window_s: float = Field(default=DEFAULT_BATCH_WINDOW_S, ge=0)
    call_timeout_s: float = Field(default=DEFAULT_CALL_TIMEOUT_S, gt=0)
    renew_every_s: float | None = Field(default=None, gt=0)
    idle_poll_s: float = Field(default=DEFAULT_IDLE_POLL_S, gt=0)
    wake_poll_s: float = Field(default=DEFAULT_WAKE_POLL_S, gt=0)
    grace_s: float = Field(default=DEFAULT_GRACE_S, ge=0)
    redis_url: RedisUrl | None = None
    prefix: KeyPrefix = DEFAULT_PREFIX
    record_ttl_s: float = Field(default=DEFAULT_RECORD_TTL_S, gt=0)
    metrics_dir: str | None = None
    handler_name: str = "handler"


@dataclass
class WorkerStats:
    """Counters of one worker, since it was built.

    Attributes:
        claimed: tasks this worker claimed, or the ingest claimed for it (``handed``).
        handed: of ``claimed``, those the ingest's accept transaction claimed for it.
        done: committed ``done``.
        retried: committed a retryable failure (back to ``pending``).
        failed: committed ``failed``.
        stale_commits: commits the store refused (fence, owner, lease, deadline), and claimed
            tasks not started because a renewal found their lease lost meanwhile.
        cancelled: tasks found cancelled; nothing committed.
        timeouts: calls abandoned (call timeout, or still running past the stop grace).
        expired: tasks whose deadline passed before their handler could start.
        renewals: successful lease renewals.
        store_errors: commits that failed on a transient store error (left to lease expiry).
    """

    claimed: int = 0
    handed: int = 0
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
        stats: WorkerStats,
        logger: logging.Logger,
        renewer: LeaseRenewer | None = None,
    ) -> None:
        self._tasks = tasks
        self._task = task
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


@dataclass
class _Ran:
    """A handler that ended, waiting for its outcome to be committed with its batch."""

    task: Task
    outcome: CallOutcome
    timeout_s: float
    ended_at: float


class Worker:
    """Claims tasks from a ``TaskStore`` and runs ``handler`` on each, one after another.

    Args:
        config: the worker's settings.
        tasks: the store (its ``policy.lease_s`` sets the default renewal interval).
        handler: a callable, or a ``"module:callable"`` spec to load.
        clock: the time source for deadlines; the store's clock by default.
        logger: where to report; ``broker_adapter.stages.worker`` by default.
        redis_client: the client to publish replies with (a ``streams.connect`` client);
            by default one for ``config.redis_url``, or none: the dispatcher publishes.
        outbox_policy: the publisher's lease and retry budget (as the dispatcher's).
        keyring: signs the replies this worker publishes (``ReplyPublisher``); required
            when it publishes (a Redis client or ``config.redis_url``).
        handoff: this worker's end of the ingest's hand-off (``handoff.HandoffEndpoint``).
            With it an idle worker waits on it (``idle_poll_s`` at most) and runs the tasks
            the ingest claimed for it, or looks or claims when told to, instead of polling
            every ``wake_poll_s``.

    Publishing its own replies (with a Redis client): the batch's commit writes the replies
    already claimed by this worker's publisher (owner ``<owner>-pub``, its lease, fence 1),
    so the dispatcher leaves them alone until that lease runs out. Right after the commit
    they are published by ``ReplyPublisher.publish`` (the dispatcher's path and crash
    points); the confirmed ones are marked sent, fenced, in the next batch's commit when
    one follows soon, else in a small transaction of their own. Rows Redis did not confirm
    go back in line with backoff (``ReplyPublisher.settle_failures``) and, for
    ``PUBLISH_PAUSE_S`` after an unreachable Redis, new replies are left to the
    dispatcher. A worker killed between its commit and its mark leaves rows ``sending``
    that the dispatcher takes back at lease expiry (the records make a second publication
    a no-op).

    Raises:
        ConfigError: the handler spec cannot be loaded, renewals would come no sooner than
            the lease expires, or the worker is to publish without a keyring.
    """

    def __init__(
        self,
        config: WorkerConfig,
        tasks: TaskStore,
        handler: Handler | str,
        *,
        clock: Clock | None = None,
        logger: logging.Logger | None = None,
        redis_client: redis.Redis | None = None,
        outbox_policy: OutboxPolicy | None = None,
        keyring: Keyring | None = None,
        handoff: IdleWait | None = None,
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
        self._renewer = LeaseRenewer(config.owner)
        self._stop: threading.Event | None = None
        self._drain_until: float | None = None
        #: Running average of this worker's handler call times (None: none ran yet).
        self._handler_s: float | None = None
        #: Tasks claimed in the last batch's commit transaction, to run next (``run`` only).
        self._ahead: list[Task] = []
        #: What this worker's own publications did (``ReplyPublisher``'s counters).
        self.publish_stats = DispatcherStats()
        self.publisher: ReplyPublisher | None = None
        if redis_client is None and config.redis_url is not None:
            redis_client = connect(config.redis_url)  # connects at its first command
        if redis_client is not None:
            if keyring is None:
                raise ConfigError(
                    f"worker {config.owner} publishes replies: it needs a keyring to sign them"
                )
            outbox = OutboxStore(tasks.db, self.clock, outbox_policy)
            self.publisher = ReplyPublisher(
                redis_client, outbox, Keys(config.prefix), f"{config.owner}-pub",
                keyring=keyring, record_ttl_s=config.record_ttl_s, stats=self.publish_stats,
                logger=self.log,
            )  # fmt: skip
        #: Publications Redis confirmed, not yet marked sent: (row, publication, when).
        self._confirmed: list[tuple[OutboxRow, Publication, float]] = []
        self._confirmed_at = 0.0  # time.monotonic() of the oldest of them
        self._publish_paused_until = 0.0
        self._handoff = handoff
        #: The last idle wait ended on the hand-off: tasks to claim, or handed (``_ahead``).
        self._woken = False
        #: The last commit also claimed, and found nothing ready.
        self._found_none = False
        self.metrics: WorkerMetrics | None = None
        if config.metrics_dir is not None:
            from broker_adapter.app.metrics import WorkerMetrics

            self.metrics = WorkerMetrics(Path(config.metrics_dir), config.handler_name)

    @property
    def owner(self) -> str:
        return self.config.owner

    def claim_size(self) -> int:
        """How many tasks the next claim takes: ``batch_window_s`` worth of handler time
        (by the running average), between 1 and ``config.batch``; ``INITIAL_CLAIM`` at most
        before any handler ran."""
        cap = self.config.batch
        if self._handler_s is None:
            return min(cap, INITIAL_CLAIM)
        if self._handler_s <= 0:
            return cap
        return max(1, min(cap, int(self.config.batch_window_s / self._handler_s)))

    def run_once(self, max_tasks: int | None = None) -> int:
        """Claim one batch and process it: run each handler, then commit the outcomes
        together (one transaction; earlier if the batch runs past ``batch_window_s``).

        Args:
            max_tasks: claim at most this many (and never more than ``claim_size()``).

        Returns:
            how many claimed tasks were processed (handled, found cancelled or expired).

        Raises:
            StoreBusy: the claim could not get the write lock; nothing was claimed.
            StoreError: the database failed.
        """
        return self._run_batch(max_tasks, claim_ahead=False)

    def _run_batch(self, max_tasks: int | None, *, claim_ahead: bool) -> int:
        """``run_once``; with ``claim_ahead`` the batch's commit transaction also claims the
        next batch (one transaction, one fsync, instead of two), run by the next call."""
        tasks, self._ahead = self._ahead, []
        self._found_none = False
        if not tasks:
            n = self.claim_size() if max_tasks is None else min(self.claim_size(), max_tasks)
            if n < 1 or self._stopping():
                return 0
            claimed = self.tasks.claim(self.config.owner, n)
            self.stats.claimed += len(claimed)
            transitions.claimed(claimed)
            # Every claimed task's lease is kept from now until its outcome is committed: a
            # task waiting its turn in the batch, or an outcome waiting for the batch's
            # commit, must not lose its lease to another worker and run twice.
            tasks = [self._keep(c) for c in claimed]
        if not tasks:  # nothing to run: no call thread to wake
            if self._stop is None:
                self._mark_sent()
            return 0
        ran: list[_Ran] = []
        finished = False
        # The handlers run back to back on a call thread (``CallRun``); this thread
        # supervises them (timeouts, the stop grace) and commits what ended: at the end of
        # the batch, or once the oldest uncommitted outcome is ``batch_window_s`` old.
        run = CallRun(self.handler, tasks, self._prepare, after=self._after_call)
        try:
            while True:
                ended = run.wait(run.supervise(self._stop, drain_deadline=self._drain_deadline))
                ran.extend(self._ran(run.take()))
                if ended:
                    break
                if ran and time.monotonic() - ran[0].ended_at >= self.config.batch_window_s:
                    self._commit(ran, more_soon=True)
                    ran = []
                elif self._confirmed and (
                    time.monotonic() - self._confirmed_at >= self.config.batch_window_s
                ):
                    self._mark_sent()
            ran.extend(self._ran(run.take()))
            finished = run.not_started == 0
        finally:
            run.halt()  # after an error here: no further handler starts
            claim_next = claim_ahead and finished
            # Offered while it commits: an accept meanwhile hands this worker its tasks
            # (claimed in the accept) instead of leaving them for a claim of its own.
            offered = self._handoff if claim_next and not self._stopping() else None
            if offered is not None:
                offered.offer(self.claim_size())
            try:
                self._commit(ran, claim_next=claim_next)
            finally:
                if offered is not None:
                    self._take_handed(offered.withdraw())
                for task in tasks:  # those not started or not committed: leases expire
                    self._release_keeper(task.task_id)
                self._sync_metrics()
        if run.not_started:
            # No release in the store yet: these leases expire and the tasks come back.
            self.log.warning(
                "stopping: %d claimed task(s) not started; they return at lease expiry",
                run.not_started,
            )
        processed = run.started
        if not self._ahead and self._stop is None:  # no commit follows to carry the marks
            self._mark_sent()
        return processed

    def run(self, stop: threading.Event) -> None:
        """Process tasks until ``stop`` is set.

        When there is nothing to claim it looks again every ``config.wake_poll_s`` for
        ``ALERT_AFTER_WORK_S`` after its last work, then at doubling intervals up to
        ``config.idle_poll_s``; a look is a read
        (``TaskStore.has_work``), a claim follows only when the look finds work. The pauses
        are waits on ``stop`` (with a hand-off: waits on it, ``idle_poll_s`` at most, and
        ``stop`` is seen after them; tasks it hands over run at once, and a wait it ends
        with ``CLAIM`` is followed by a claim straight away, without the look). Once
        ``stop`` is set it claims nothing more; the running handler (and any task of the
        batch already claimed or handed) gets ``config.grace_s`` from that moment to
        finish. A handler still running then is abandoned and its task handed back as a
        retryable failure.

        Args:
            stop: set it (e.g. from a SIGTERM handler) to drain and return.

        Raises:
            StoreError: the database failed.
        """
        self._stop = stop
        self._drain_until = None
        # With a hand-off, new work is announced: the poll is only the fallback.
        first_pause = self.config.wake_poll_s if self._handoff is None else self.config.idle_poll_s
        pause = first_pause
        busy_at = time.monotonic()
        try:
            while not stop.is_set() or self._ahead:  # tasks claimed ahead run in the drain
                try:
                    processed = self._run_batch(None, claim_ahead=True)
                except TransientError as exc:
                    self.log.warning("claim failed, will retry: %s", exc)
                    processed = 0
                if processed:
                    busy_at = time.monotonic()
                    pause = first_pause
                    if self._ahead or not self._found_none:
                        continue
                    # The commit's claim found nothing: look (a read) before claiming again.
                while not self._idle_wait(stop, self._until_marks_due(pause)):
                    if self._confirmed and self._until_marks_due(pause) <= 0:
                        self._mark_sent()  # no commit came in time to carry them
                    if self._woken:
                        break  # new tasks were committed: claim, no look first
                    if time.monotonic() - busy_at >= ALERT_AFTER_WORK_S:
                        pause = min(pause * 2, self.config.idle_poll_s)
                    try:
                        if self.tasks.has_work():
                            break
                    except TransientError as exc:
                        self.log.warning("looking for work failed, will retry: %s", exc)
            self._mark_sent()
        finally:
            self._stop = None

    def _until_marks_due(self, pause: float) -> float:
        """How long an idle wait may last: ``pause``, or less when confirmed publications
        wait to be marked (they wait ``batch_window_s`` at most for a commit to carry them)."""
        if not self._confirmed:
            return pause
        due = self._confirmed_at + self.config.batch_window_s - time.monotonic()
        return max(0.0, min(pause, due))

    def _idle_wait(self, stop: threading.Event, pause: float) -> bool:
        """Wait ``pause`` (or until the hand-off brings tasks, or says to claim:
        ``self._woken``; handed tasks are kept as ``_ahead``); returns whether ``stop`` is
        set. Tasks handed while stopping run in the drain, as tasks claimed ahead do."""
        if self._handoff is None:
            self._woken = False
            return stop.wait(pause)
        got = self._handoff.wait(pause, self.claim_size())
        self._woken = got == CLAIM or self._take_handed(got)
        return stop.is_set()

    def _take_handed(self, got: Handed) -> bool:
        """Add the tasks handed over (claimed for this worker by an accept) to those to
        run next; returns whether there were any."""
        if not isinstance(got, list) or not got:
            return False
        try:
            claimed = self.tasks.handed(self.config.owner, got)
        except TransientError as exc:  # they come back at lease expiry
            self.log.warning("reading %d handed task(s) failed: %s", len(got), exc)
            claimed = []
        self.stats.claimed += len(claimed)
        self.stats.handed += len(claimed)
        transitions.claimed(claimed, "handoff")
        self._ahead.extend(self._keep(c) for c in claimed)
        return True

    def renew_leases(self) -> int:
        """Renew the lease of every claimed task now, out of the keeper's schedule.

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

    def _keep(self, claimed: ClaimedTask) -> Task:
        """The handler's view of a claimed task, with its lease kept from now on."""
        task = Task(claimed, clock=self.clock, cancel_check=partial(self._still_held, claimed))
        keeper = LeaseKeeper(
            self.tasks, task, self.renew_every_s, self.stats, self.log, self._renewer
        )
        with self._keepers_lock:
            self._keepers[claimed.task_id] = keeper
        keeper.start()
        return task

    def _still_held(self, claimed: ClaimedTask) -> bool | StaleError:
        """``Task.cancelled()``'s look at the store (``TaskStore.refusal``): True when the
        task was cancelled, the refusal when this worker no longer holds it (fence, owner,
        lease), False while it does. A claim that moved on while this worker was frozen is
        seen before its handler starts, not only at the next renewal. (Takes the claim, not
        the ``Task``: no reference cycle per task for the garbage collector to find.)"""
        refusal = self.tasks.refusal(claimed.task_id, claimed.owner, claimed.fence)
        if isinstance(refusal, TaskCancelled):
            return True
        return refusal if refusal is not None else False

    def _release_keeper(self, task_id: str) -> None:
        """Stop renewing ``task_id``; returns after a renewal in flight has ended."""
        with self._keepers_lock:
            keeper = self._keepers.pop(task_id, None)
        if keeper is not None:
            keeper.stop()

    def _prepare(self, task: Task) -> float | None:
        """Before one claimed task's handler (on the call thread): its timeout, or ``None``
        when it is not to run (cancelled, lease lost while it waited its turn, or its
        deadline passed first).

        Raises:
            StopRun: stopping, and the drain deadline has passed: the rest is not started.
        """
        # A stop that lands after the claim (a signal during it) still lets the claimed
        # tasks run: they are ours, and leaving them costs an attempt and a lease period.
        # They share one drain deadline, ``grace_s`` after the stop was first seen.
        if self._stopping() and self._drain_deadline() <= time.monotonic():
            raise StopRun
        claimed = task.claimed
        crashpoints.hit("worker.after_claim")
        if task.cancelled():
            self._release_keeper(claimed.task_id)
            if task.stop_reason == "lease_lost":  # a renewal was refused while it waited
                self.stats.stale_commits += 1
                transitions.claim_transition("stale", claimed, None, detail=str(task.lease_lost))
                self.log.warning(
                    "task %s lost its lease before its handler started: %s",
                    claimed.task_id,
                    task.lease_lost,
                )
                return None
            self.stats.cancelled += 1
            transitions.claim_transition("cancelled", claimed, "cancelled", detail="not started")
            return None
        time_left_s = claimed.deadline - self.clock.now()
        if time_left_s <= 0:
            # Reconcile moves it to ``expired`` with its reply; running it would be refused.
            self._release_keeper(claimed.task_id)
            self.tasks.reconcile()
            self.stats.expired += 1
            transitions.claim_transition("expired", claimed, "expired", detail="not started")
            return None
        return min(self.config.call_timeout_s, time_left_s)

    @staticmethod
    def _after_call() -> None:
        crashpoints.hit("worker.after_effect")

    def _ran(self, ended: list[RunOutcome]) -> list[_Ran]:
        """The run's ended calls, as outcomes to commit; each call's time feeds the running
        average that sizes claims."""
        out: list[_Ran] = []
        for end in ended:
            elapsed = end.outcome.elapsed_s
            if self.metrics is not None:
                self.metrics.observe_call(elapsed)
            avg = self._handler_s
            self._handler_s = (
                elapsed if avg is None else avg + HANDLER_TIME_WEIGHT * (elapsed - avg)
            )
            out.append(_Ran(end.task, end.outcome, end.timeout_s, end.ended_at))
        return out

    def _commit(
        self, ran: list[_Ran], *, claim_next: bool = False, more_soon: bool = False
    ) -> None:
        """Write the outcomes of a batch (each fenced) in one transaction; with
        ``claim_next`` (and not stopping) the same transaction claims the next batch.
        ``more_soon``: another commit follows (tasks of this batch are left), which can
        carry the marks of the replies published after this one."""
        if not ran:
            return
        # Stop renewing before the commit: a renewal racing the commit would be refused
        # ("not running") and report a lost lease that was in fact released.
        for r in ran:
            self._release_keeper(r.task.task_id)
        items: list[tuple[ClaimedTask, Settlement]] = []
        for r in ran:
            claimed = r.task.claimed
            # Rule 11: the last check before the commit is in the commit's transaction: the
            # store refuses a cancelled task (TaskCancelled) and keeps its ``cancelled``.
            if r.task.stop_reason == "cancelled":
                self._note_cancelled(claimed)
                continue
            items.append((claimed, self._settlement(claimed, r.outcome, r.timeout_s)))
        n = self.claim_size() if claim_next and not self._stopping() else 0
        try:
            batch = self._settle([item for _, item in items], n)
        except TransientError as exc:
            self.stats.store_errors += len(items)
            self.log.warning(
                "commit of %d task(s) failed; they return at lease expiry: %s", len(items), exc
            )
            return
        transitions.settled([c for c, _ in items], batch.results,
                            {r.task.task_id: r.outcome.elapsed_s for r in ran})  # fmt: skip
        for (claimed, _item), result in zip(items, batch.results, strict=True):
            if isinstance(result, TaskCancelled):
                self._note_cancelled(claimed)
            elif isinstance(result, StaleError):
                self.stats.stale_commits += 1
                self.log.warning(
                    "stale commit refused for task %s (owner %s, fence %d): %s",
                    claimed.task_id,
                    claimed.owner,
                    claimed.fence,
                    result,
                )
            else:
                if isinstance(result, FailOutcome):
                    if result is FailOutcome.RETRY:
                        self.stats.retried += 1
                    else:
                        self.stats.failed += 1
                else:
                    self.stats.done += 1
                crashpoints.hit("worker.after_finish")
        self.stats.claimed += len(batch.claimed)
        transitions.claimed(batch.claimed)
        self._ahead = [self._keep(c) for c in batch.claimed]
        self._found_none = n >= 1 and not batch.claimed
        if batch.replies:
            self._publish(batch.replies, more_soon=more_soon or bool(self._ahead))

    # -- replies ----------------------------------------------------------------------------

    def _publishing(self) -> ReplyPublisher | None:
        """The publisher, unless there is none or it pauses after a Redis failure."""
        if self.publisher is None or time.monotonic() < self._publish_paused_until:
            return None
        return self.publisher

    def _settle(self, items: list[Settlement], n: int) -> SettledBatch:
        """The batch's one transaction: outcomes, replies (claimed by the publisher when it
        publishes), the marks of confirmed publications waiting for it, the next claim."""
        publisher = self._publishing()
        if publisher is None:
            self._mark_sent()  # a paused publisher's marks do not wait for the next commit
            return self.tasks.settle_batch(items, self.config.owner, n)
        confirmed, self._confirmed = self._confirmed, []
        try:
            batch = self.tasks.settle_batch(
                items, self.config.owner, n, publish_as=publisher.owner,
                publish_lease_s=publisher.outbox.policy.lease_s, sent=_marks(confirmed),
            )  # fmt: skip
        except BaseException:
            self._confirmed = confirmed + self._confirmed  # not written: still to mark
            raise
        if confirmed:
            crashpoints.hit("dispatcher.after_mark_sent")
            publisher.count_marked([(row, pub) for row, pub, _ in confirmed], batch.marks)
        return batch

    def _publish(self, rows: list[OutboxRow], *, more_soon: bool) -> None:
        """Publish the replies the batch's commit wrote claimed for this worker's publisher;
        the confirmed ones wait for the next commit to be marked sent (``_mark_sent`` when
        none follows soon), the others go back in line with backoff, or ``dead``."""
        publisher = self.publisher
        assert publisher is not None
        pubs = publisher.publish(rows)
        confirmed_at = self.clock.now()
        done = publisher.confirmed(rows, pubs)
        if not self._confirmed:
            self._confirmed_at = time.monotonic()
        self._confirmed += [(row, pub, confirmed_at) for row, pub in done]
        if len(done) < len(rows):
            unreachable = [p for p in pubs if p.transient]
            if unreachable:
                self._publish_paused_until = time.monotonic() + PUBLISH_PAUSE_S
                self.log.warning(
                    "publishing %d replies failed (left to the dispatcher for %.1f s): %s",
                    len(unreachable),
                    PUBLISH_PAUSE_S,
                    unreachable[0].detail,
                )
            try:
                publisher.settle_failures(rows, pubs)
            except TransientError as exc:
                self.log.warning(
                    "replies not put back in line; they return at lease expiry: %s", exc
                )
        # In ``run`` the marks wait for the next commit (work follows, or arrives within
        # ``batch_window_s``: the idle loop marks them then at the latest).
        slow = self._handler_s is None or self._handler_s > self.config.batch_window_s
        if slow or self._stopping() or not (more_soon or self._stop is not None):
            self._mark_sent()

    def _mark_sent(self) -> None:
        """Mark the confirmed publications sent now, in one transaction of their own."""
        if not self._confirmed or self.publisher is None:
            return
        confirmed, self._confirmed = self._confirmed, []
        publisher = self.publisher
        try:
            refused = publisher.outbox.mark_sent_marks(publisher.owner, _marks(confirmed))
        except TransientError as exc:
            # Published and recorded in Redis: when the lease runs out the dispatcher takes
            # them back, its publication finds the records and marks them sent.
            self.log.warning("%d replies not marked sent: %s", len(confirmed), exc)
            return
        crashpoints.hit("dispatcher.after_mark_sent")
        publisher.count_marked([(row, pub) for row, pub, _ in confirmed], refused)
        self._sync_metrics()

    def _sync_metrics(self) -> None:
        """Hand the counters to the metrics files: after each batch's commit and each
        mark-sent transaction of its own (what they committed is then counted)."""
        if self.metrics is not None:
            self.metrics.sync(self.stats, self.publish_stats, self.tasks.lease_takeovers)

    def _settlement(
        self, claimed: ClaimedTask, outcome: CallOutcome, timeout_s: float
    ) -> Settlement:
        """What to commit for one handler outcome."""
        fail = partial(Settlement, claimed.task_id, claimed.owner, claimed.fence, None)
        if outcome.ok:
            try:
                encoded = check_result(outcome.value).decode("utf-8")
            except EnvelopeError as exc:  # deterministic: the same result is as large again
                return fail(f"{RESULT_TOO_LARGE}: {exc.detail}", False)
            except (TypeError, ValueError, RecursionError) as exc:
                error = f"{type(exc).__name__}: the handler returned a non-JSON result: {exc}"
                return fail(error, False)
            return Settlement(
                claimed.task_id, claimed.owner, claimed.fence, encoded, claimed=claimed
            )
        if outcome.timed_out:
            self.stats.timeouts += 1
            error = f"TimeoutError: the handler did not return within {timeout_s:.3f} s"
            self._log_failure(claimed, error, retry=True)
            return fail(error, True)
        if outcome.stopped:
            self.stats.timeouts += 1
            error = (
                f"WorkerStopping: the handler did not finish within the "
                f"{self.config.grace_s} s shutdown grace"
            )
            self._log_failure(claimed, error, retry=True)
            return fail(error, True)
        assert outcome.error is not None
        raised = outcome.error
        error, retry = describe_error(raised), is_retryable(raised)
        self._log_failure(claimed, error, retry=retry, raised=raised)
        return fail(error, retry)

    def _log_failure(
        self, claimed: ClaimedTask, error: str, *, retry: bool, raised: BaseException | None = None
    ) -> None:
        """Log a handler's failure with the task's ids (never its payload): a warning when
        it asks for another attempt, an error otherwise, and the traceback unless the
        handler asked for a retry on purpose (``RetryableError``)."""
        self.log.log(
            logging.WARNING if retry else logging.ERROR,
            "handler failed on task %s (message %s from %s, attempt %d of %d%s): %s",
            claimed.task_id,
            claimed.message_id,
            claimed.principal,
            claimed.attempt,
            claimed.max_attempts,
            ", asks for a retry" if retry else "",
            error,
            exc_info=None if raised is None or isinstance(raised, RetryableError) else raised,
            extra=transitions.claim_fields(claimed),
        )

    def _note_cancelled(self, claimed: ClaimedTask) -> None:
        self.stats.cancelled += 1
        transitions.claim_transition("cancelled", claimed, "cancelled", detail="cancelled while"
                                     " its handler ran; an effect it caused stays")  # fmt: skip


def _marks(confirmed: list[tuple[OutboxRow, Publication, float]]) -> list[SentMark]:
    """Confirmed publications as ``(reply_id, fence, entry_id, sent_at)`` marks."""
    return [(row.reply_id, row.fence, pub.entry_id or "", at) for row, pub, at in confirmed]
