"""The worker: claims tasks, runs their handlers under a renewed lease, commits each outcome.

Rules kept (``docs/RULES.md``): 9, no handler runs inside a transaction (claims, renewals
and commits are short transactions of their own; the handler runs between them on a call
thread); 10, every commit presents the claim's owner and fence, and a refused (stale) one
is counted, logged and dropped, never retried or forced; 11, cancellation is checked before
the start (``task_start``), at every renewal and at the commit, and a cancelled task's
outcome is dropped (its effect, if any, stays).

Batches: a claim takes up to ``WorkerConfig.batch`` tasks, sized by the running average of
handler times to about ``batch_window_s``. The handlers run back to back on one call
thread (``calls.CallRun``) while this thread supervises their timeouts; their outcomes
(``outcomes.settlement``) commit together in one ``TaskStore.settle_batch`` (each fenced on
its own), which in ``run`` also claims the next batch. Every claimed task's lease is kept
from claim to commit (``lease.Leases``). Idle, ``run`` waits on the ingest's hand-off
(``loop.IdleWait``) or follows the idle policy (``loop.IdlePolicy``).

Replies (given a Redis client): the commit writes each reply already claimed by
this worker's publisher (rules 13, 14), published right after it (``replies.OwnReplies``);
their sent marks ride on the next commit or a small transaction of their own. A kill in
between leaves rows ``sending`` that the dispatcher takes back after the publisher lease.

Crash: nothing durable is kept here. Killed after the claim (``worker.after_claim``) or the
effect (``worker.after_effect``), a task stays ``running`` until its lease expires, then
runs again with attempts+1 and fence+1 (an effect keyed by ``Task.idempotency_key`` applies
once); a declared side effect (``effect_gate``) goes to ``unknown`` instead. Killed after
the commit (``worker.after_finish``), state and reply are durable together.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker_adapter import crashpoints
from broker_adapter.clock import Clock
from broker_adapter.errors import (
    ConfigError,
    TransientError,
)
from broker_adapter.handler.router import Router
from broker_adapter.handler.task import Task
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.signing import Keyring
from broker_adapter.stages.shared.calls import CallOutcome, RunOutcome, StopRun
from broker_adapter.stages.shared.handlers import Handler, load_handler
from broker_adapter.stages.shared.loop import (
    CLAIM,
    Handed,
    IdlePolicy,
    IdleWait,
    look,
    run_stage,
)
from broker_adapter.stages.shared.publish import DispatcherStats, ReplyPublisher
from broker_adapter.stages.worker.concurrent_run import ConcurrentRun
from broker_adapter.stages.worker.config import (
    HANDLER_TIME_WEIGHT,
    INITIAL_CLAIM,
    WorkerConfig,
    WorkerMetricsSink,
    WorkerStats,
)
from broker_adapter.stages.worker.effect_gate import EffectGate, stopped_how
from broker_adapter.stages.worker.lease import Leases, renew_interval
from broker_adapter.stages.worker.outcomes import count_committed, note_cancelled, settlement
from broker_adapter.stages.worker.replies import OwnReplies
from broker_adapter.stages.worker.routing import Routes, TaskLimits
from broker_adapter.stages.worker.task_start import TaskStart
from broker_adapter.store import transitions
from broker_adapter.store.outbox import OutboxStore
from broker_adapter.store.outbox_types import OutboxPolicy, OutboxRow
from broker_adapter.store.settle import SettledBatch, Settlement
from broker_adapter.store.task_types import ClaimedTask
from broker_adapter.store.tasks import TaskStore

if TYPE_CHECKING:
    from broker_adapter.redis.client import Redis


@dataclass
class _Ran:
    """A handler that ended, waiting for its outcome to be committed with its batch."""

    task: Task
    outcome: CallOutcome
    timeout_s: float
    ended_at: float


class Worker:
    """Claims tasks from a ``TaskStore`` and runs their handlers, one after another.

    Args:
        config: the worker's settings.
        tasks: the store (its ``policy.lease_s`` sets the default renewal interval).
        handler: a ``Router`` of named tasks (``routing.Routes`` routes each claimed task),
            a callable (a router of one), or a ``"module:callable"`` spec to load.
        clock: the time source for deadlines; the store's clock by default.
        logger: where to report; ``broker_adapter.stages.worker`` by default.
        redis_client: the client to publish replies with (a ``redis.client.connect``
            client); ``None``: none, the dispatcher publishes them.
        outbox_policy: the publisher's lease and retry budget (as the dispatcher's).
        keyring: signs the replies this worker publishes (``ReplyPublisher``); required
            when it publishes (a ``redis_client``).
        handoff: this worker's end of the ingest's hand-off (``handoff.HandoffEndpoint``).
            With it an idle worker waits on it (``idle_poll_s`` at most) and runs the tasks
            the ingest claimed for it, or looks or claims when told to, instead of polling
            every ``wake_poll_s``.
        outbox: the outbox of ``tasks``' database, for the replies this worker publishes
            (its own policy applies); ``None``: an ``OutboxStore`` on a SQLite
            ``TaskStore``'s database, with ``outbox_policy``.
        metrics: where handler times and counters go (the pool gives one when
            it has a ``metrics_dir``: ``app.metrics.WorkerMetrics``); ``None``: none.
        limits: per-task concurrency limits to share with other workers of this process
            (``routing.TaskLimits``); ``None``: its own.

    Publishing its own replies: see the module's text and ``replies.OwnReplies``.

    Raises:
        ConfigError: the handler spec cannot be loaded, renewals would come no sooner than
            the lease expires, or the worker is to publish without a keyring.
    """

    def __init__(
        self,
        config: WorkerConfig,
        tasks: TaskStore,
        handler: Router | Handler | str,
        *,
        clock: Clock | None = None,
        logger: logging.Logger | None = None,
        redis_client: Redis | None = None,
        outbox_policy: OutboxPolicy | None = None,
        keyring: Keyring | None = None,
        handoff: IdleWait | None = None,
        outbox: OutboxStore | None = None,
        metrics: WorkerMetricsSink | None = None,
        limits: TaskLimits | None = None,
    ) -> None:
        self.config = config
        self.tasks = tasks
        loaded = load_handler(handler) if isinstance(handler, str) else handler
        router = loaded if isinstance(loaded, Router) else Router.of_handler(loaded)
        self.clock = clock or tasks.clock
        self.log = logger or logging.getLogger("broker_adapter.stages.worker")
        self.renew_every_s = renew_interval(tasks.policy.lease_s, config.renew_every_s)
        self.stats = WorkerStats()
        #: The lease of every claimed task, kept from its claim until its commit.
        self.leases = Leases(
            tasks, config.owner, self.renew_every_s, self.clock, self.stats, self.log
        )
        self._drain_lock = threading.Lock()
        self._stop: threading.Event | None = None
        self._drain_until: float | None = None
        #: Running average of this worker's handler call times (None: none ran yet).
        self._handler_s: float | None = None
        #: Tasks claimed in the last batch's commit transaction, to run next (``run`` only).
        self._ahead: list[Task] = []
        #: What this worker's own publications did (``ReplyPublisher``'s counters).
        self.publish_stats = DispatcherStats()
        self.publisher: ReplyPublisher | None = None
        if redis_client is not None:
            if keyring is None:
                raise ConfigError(
                    f"worker {config.owner} publishes replies: it needs a keyring to sign them"
                )
            if outbox is None:
                outbox = OutboxStore(tasks.db, self.clock, outbox_policy)
            self.publisher = ReplyPublisher(
                redis_client,
                outbox,
                Keys(config.prefix),
                f"{config.owner}-pub",
                keyring=keyring,
                record_ttl_s=config.record_ttl_s,
                stats=self.publish_stats,
                logger=self.log,
            )
        self._replies = None if self.publisher is None else OwnReplies(self.publisher, self.clock)
        self._handoff = handoff
        #: The last idle wait ended on the hand-off: tasks to claim, or handed (``_ahead``).
        self._woken = False
        #: The last commit also claimed, and found nothing ready.
        self._found_none = False
        self.metrics = metrics
        #: The tasks served, with the approvals and effect marks of each declared side
        #: effect (``EffectGate``; an ordinary handler's only cost: one check per task).
        self.routes = Routes(
            router,
            lambda spec: EffectGate(
                tasks, spec, self.leases, config.approval_timeout_s, self.stats, self.log
            ),
            limits,
        )
        #: The default handler's gate (``None``: it declares no effect).
        self.effects: EffectGate | None = self.routes.gate_named(None)
        #: What the call run calls: the routed task's handler (``Routes.call``).
        self.handler: Handler = self.routes.call
        self._start = TaskStart(
            tasks, self.leases, self.clock, self.stats, self.log, config.call_timeout_s, None
        )

    @property
    def owner(self) -> str:
        return self.config.owner

    def claim_size(self) -> int:
        """How many tasks the next claim takes: ``batch_window_s`` worth of handler time
        (by the running average), between 1 and ``config.batch``; ``INITIAL_CLAIM`` at most
        before any handler ran."""
        slots = self.config.concurrency  # calls at once: a claim fills each slot
        cap = max(self.config.batch, slots)
        if self._handler_s is None:
            return min(cap, INITIAL_CLAIM if slots == 1 else slots)
        if self._handler_s <= 0:
            return cap
        per_slot = max(1, int(self.config.batch_window_s / self._handler_s))
        return min(cap, slots * per_slot)

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
            tasks = [self.leases.keep(c) for c in claimed]
        if not tasks:  # nothing to run: no call thread to wake
            if self._stop is None:
                self._mark_sent()
            return 0
        ran: list[_Ran] = []
        finished = False
        # The handlers run back to back on a call thread per slot (``ConcurrentRun``, one
        # ``CallRun`` per slot of ``concurrency``); this thread
        # supervises them (timeouts, the stop grace) and commits what ended: at the end of
        # the batch, or once the oldest uncommitted outcome is ``batch_window_s`` old.
        run = ConcurrentRun(
            self.handler, tasks, self._prepare, self._after_call, self.config.concurrency
        )
        try:
            while True:
                ended = run.wait(run.supervise(self._stop, drain_deadline=self._drain_deadline))
                ran.extend(self._ran(run.take()))
                if ended:
                    break
                if ran and time.monotonic() - ran[0].ended_at >= self.config.batch_window_s:
                    self._commit(ran, more_soon=True)
                    ran = []
                elif (
                    self._replies is not None
                    and self._replies.waiting
                    and (
                        time.monotonic() - self._replies.confirmed_at >= self.config.batch_window_s
                    )
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
                    self.leases.release(task.task_id)
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
        """Process tasks until ``stop`` is set (``loop.run_stage``: a transient failure, e.g.
        a busy store at the claim, backs off and the loop goes on).

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
        retryable failure. Tasks claimed ahead (or handed while stopping) run in the drain.

        Args:
            stop: set it (e.g. from a SIGTERM handler) to drain and return.

        Raises:
            StoreError: the database failed.
        """
        self._stop = stop
        self._drain_until = None
        # With a hand-off, new work is announced: the poll is only the fallback.
        first_pause = self.config.wake_poll_s if self._handoff is None else self.config.idle_poll_s
        idle = IdlePolicy(first_pause, self.config.idle_poll_s)

        def step() -> bool:
            if not self._run_batch(None, claim_ahead=True):
                return False
            idle.worked()
            # The commit's claim found nothing: look (a read) before claiming again.
            return bool(self._ahead) or not self._found_none

        def wait() -> None:
            idle.wait_for_work(
                lambda pause: self._idle_wait(stop, self._until_marks_due(pause)),
                lambda: look(self.tasks.has_work, self.log, "looking for work"),
                handed=lambda: self._woken_while_idle(idle.pause_s),
            )

        try:
            run_stage(
                stop,
                step,
                log=self.log,
                what="worker",
                wait=wait,
                pending=lambda: bool(self._ahead),  # tasks claimed ahead run in the drain
            )
            self._mark_sent()
        finally:
            self._stop = None

    def _woken_while_idle(self, pause: float) -> bool:
        """After an idle pause: mark the confirmed publications no commit came in time to
        carry; whether the hand-off said new tasks were committed (claim, no look first)."""
        if self._marks_waiting() and self._until_marks_due(pause) <= 0:
            self._mark_sent()
        return self._woken

    def _until_marks_due(self, pause: float) -> float:
        """How long an idle wait may last: ``pause``, or less when confirmed publications
        wait to be marked (they wait ``batch_window_s`` at most for a commit to carry them)."""
        if self._replies is None or not self._replies.waiting:
            return pause
        due = self._replies.confirmed_at + self.config.batch_window_s - time.monotonic()
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
        self._ahead.extend(self.leases.keep(c) for c in claimed)
        return True

    def renew_leases(self) -> int:
        """Renew the lease of every claimed task now, out of the keeper's schedule.

        Returns:
            how many leases are still held afterwards.
        """
        return self.leases.renew_all()

    # -- one task -------------------------------------------------------------------------

    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def _drain_deadline(self) -> float:
        """The ``time.monotonic()`` instant a stopping worker must be done by (set once)."""
        with self._drain_lock:
            if self._drain_until is None:
                self._drain_until = time.monotonic() + self.config.grace_s
            return self._drain_until

    def _prepare(self, task: Task) -> float | None:
        """Before one claimed task's handler (on the call thread): its timeout, or ``None``
        when it is not to run (``task_start.TaskStart.prepare``).

        Raises:
            StopRun: stopping, and the drain deadline has passed: the rest is not started.
        """
        # A stop that lands after the claim (a signal during it) still lets the claimed
        # tasks run: they are ours, and leaving them costs an attempt and a lease period.
        # They share one drain deadline, ``grace_s`` after the stop was first seen.
        if self._stopping() and self._drain_deadline() <= time.monotonic():
            raise StopRun
        spec = self.routes.route(task)  # unroutable (None): its call fails, no handler runs
        gate = None if spec is None else self.routes.gate(task)
        limit = None if spec is None else spec.call_timeout_s
        timeout = self._start.prepare(task, gate=gate, call_timeout_s=limit)
        if timeout is None:  # not to run: no call takes its route
            self.routes.forget(task)
        return timeout

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
                self.metrics.observe_call(elapsed, end.task.task_name or "")
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
            self.leases.release(r.task.task_id)
        items: list[tuple[ClaimedTask, Settlement]] = []
        for r in ran:
            claimed = r.task.claimed
            # Rule 11: the last check before the commit is in the commit's transaction: the
            # store refuses a cancelled task (TaskCancelled) and keeps its ``cancelled``.
            gate = self.routes.gate(r.task)
            if gate is not None and gate.after_call(r.task, r.outcome):
                continue  # its effect started: ``unknown`` (or nothing left to write)
            if r.task.stop_reason == "cancelled" and not r.outcome.ok:
                # Stopped on a cancel (requested: ended here, with what is known; made
                # outright: already ``cancelled``). A result it returned is still committed:
                # the store refuses it if the task was cancelled outright.
                self._start.end_cancel(claimed, stopped_how(r.task, r.outcome))
                note_cancelled(claimed, self.stats, self.log)
                continue
            grace_s = self.config.grace_s
            item = settlement(
                claimed, r.outcome, r.timeout_s, grace_s=grace_s, stats=self.stats, log=self.log
            )
            items.append((claimed, self.routes.cap_attempts(claimed, item)))
        n = self.claim_size() if claim_next and not self._stopping() else 0
        try:
            batch = self._settle([item for _, item in items], n)
        except TransientError as exc:
            self.stats.store_errors += len(items)
            self.log.warning(
                "commit of %d task(s) failed; they return at lease expiry: %s", len(items), exc
            )
            return
        transitions.settled(
            [c for c, _ in items], batch.results, {r.task.task_id: r.outcome.elapsed_s for r in ran}
        )
        for (claimed, _item), result in zip(items, batch.results, strict=True):
            count_committed(claimed, result, self.stats, self.log)
        self.stats.claimed += len(batch.claimed)
        transitions.claimed(batch.claimed)
        self._ahead = [self.leases.keep(c) for c in batch.claimed]
        self._found_none = n >= 1 and not batch.claimed
        if batch.replies:
            self._publish(batch.replies, more_soon=more_soon or bool(self._ahead))

    # -- replies ----------------------------------------------------------------------------

    def _marks_waiting(self) -> bool:
        return self._replies is not None and self._replies.waiting

    def _settle(self, items: list[Settlement], n: int) -> SettledBatch:
        """The batch's one transaction: outcomes, replies (claimed by the publisher when it
        publishes), the marks of confirmed publications waiting for it, the next claim."""
        replies = self._replies
        if replies is None or replies.paused():
            self._mark_sent()  # a paused publisher's marks do not wait for the next commit
            return self.tasks.settle_batch(items, self.config.owner, n)
        return replies.settle_batch(self.tasks, items, self.config.owner, n)

    def _publish(self, rows: list[OutboxRow], *, more_soon: bool) -> None:
        """Publish the replies the batch's commit wrote claimed for this worker's publisher
        (``OwnReplies.publish``); the confirmed ones wait for the next commit to be marked
        sent (``_mark_sent`` when none follows soon)."""
        assert self._replies is not None
        self._replies.publish(rows)
        # In ``run`` the marks wait for the next commit (work follows, or arrives within
        # ``batch_window_s``: the idle loop marks them then at the latest).
        slow = self._handler_s is None or self._handler_s > self.config.batch_window_s
        if slow or self._stopping() or not (more_soon or self._stop is not None):
            self._mark_sent()

    def _mark_sent(self) -> None:
        """Mark the confirmed publications sent now, in one transaction of their own."""
        if self._replies is not None and self._replies.mark_sent():
            self._sync_metrics()

    def _sync_metrics(self) -> None:
        """Hand the counters to the metrics files: after each batch's commit and each
        mark-sent transaction of its own (what they committed is then counted)."""
        if self.metrics is not None:
            self.metrics.sync(self.stats, self.publish_stats, self.tasks.lease_takeovers)
