"""A worker's section of the settings tree (``WorkerSettings``), its settings
(``WorkerConfig``), counters (``WorkerStats``), the sink its metrics go to and its fixed
constants; see ``worker``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pydantic import Field

from broker_adapter.config import ConfigModel, setting
from broker_adapter.metric_fields import Family
from broker_adapter.protocol.keys import PREFIX_SETTING, KeyPrefix
from broker_adapter.stages.shared.loop import DEFAULT_IDLE_POLL_S, DEFAULT_WAKE_POLL_S
from broker_adapter.stages.shared.publish import DEFAULT_RECORD_TTL_S, DispatcherStats

DEFAULT_BATCH = 128
DEFAULT_BATCH_WINDOW_S = 0.05
DEFAULT_CALL_TIMEOUT_S = 60.0
DEFAULT_GRACE_S = 10.0
DEFAULT_APPROVAL_TIMEOUT_S = 3600.0
#: The most tasks one worker process runs at once (``WorkerConfig.concurrency``).
MAX_CONCURRENCY = 256


class WorkerSettings(ConfigModel):
    """The worker's section of the settings tree (``AdapterConfig.worker``): what ``run``
    sets of how each worker process runs handlers. ``WorkerConfig`` extends it.

    Attributes:
        concurrency: how many handler calls run at once (``concurrent_run``): a claim
            takes enough tasks to fill each slot; async handlers wait together on the
            process's one event loop, sync ones run on a thread per slot.
        call_timeout_s: per handler call; capped by the time left to the task's deadline
            (a task's own ``call_timeout_s`` overrides it).
        grace_s: on stop, how long the running handlers may still take.
    """

    concurrency: int = setting(
        1,
        ge=1,
        le=MAX_CONCURRENCY,
        help="tasks each worker process runs at once; async handlers share its one event loop",
        flag="--concurrency",
        env="BA_CONCURRENCY",
        metavar="N",
    )
    call_timeout_s: float = setting(
        DEFAULT_CALL_TIMEOUT_S,
        gt=0,
        help="a handler call's timeout, seconds (a task's own overrides it; the deadline caps it)",
        flag="--call-timeout",
        env="BA_CALL_TIMEOUT_S",
        metavar="S",
    )
    grace_s: float = setting(
        DEFAULT_GRACE_S,
        ge=0,
        help="on SIGTERM, how long running handlers may finish, seconds",
        flag="--grace",
        env="BA_GRACE_S",
        metavar="S",
    )


class WorkerConfig(WorkerSettings):
    """One worker's settings: its section of the tree (``WorkerSettings``, whose attributes
    it has) and what one worker needs besides.

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
        renew_every_s: lease renewal interval; ``None`` means a third of the store's lease.
        idle_poll_s: the longest pause between two looks for work when idle, seconds. A
            look is a read (``TaskStore.has_work``: no write lock, no fsync); a claim
            follows only when it finds something.
        wake_poll_s: the pause between looks for ``loop.ALERT_AFTER_WORK_S`` after the last
            work, seconds; after that it doubles with every empty look, up to
            ``idle_poll_s``.
        prefix: the key prefix (see ``keys``), as the dispatcher's.
        record_ttl_s: how long its publication records live (the dispatcher's
            ``DispatcherConfig.record_window_s``).
        approval_timeout_s: for a handler whose effect ``requires_approval``
            (``handler.effects.side_effect``): how long a task waits in ``waiting_approval`` for a
            valid approval record before it ends ``failed`` (never past its deadline).
    """

    owner: str = Field(min_length=1, max_length=128)
    batch: int = Field(default=DEFAULT_BATCH, ge=1, le=1000)
    batch_window_s: float = Field(default=DEFAULT_BATCH_WINDOW_S, ge=0)
    renew_every_s: float | None = Field(default=None, gt=0)
    idle_poll_s: float = Field(default=DEFAULT_IDLE_POLL_S, gt=0)
    wake_poll_s: float = Field(default=DEFAULT_WAKE_POLL_S, gt=0)
    prefix: KeyPrefix = PREFIX_SETTING
    record_ttl_s: float = Field(default=DEFAULT_RECORD_TTL_S, gt=0)
    approval_timeout_s: float = Field(default=DEFAULT_APPROVAL_TIMEOUT_S, gt=0)


#: Task outcomes; a worker's are counted in its memory, ``unknown`` by the database.
TASK_OUTCOMES = Family("ba_task_outcomes", "Task outcomes committed by workers.")


@dataclass
class WorkerStats:
    """Counters of one worker, since it was built; the exported ones declare their metric
    (``metric_fields``).

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
        unknown: tasks of a declared effect given up after the effect started (timeout,
            stop, an error asking for a retry): ``unknown``, for the reconcile.
        waiting_approval: tasks parked for an approval record before their effect.
    """

    #: not exported from here: ``ba_task_attempts_total`` is counted by the database in
    #: the claim's transaction
    claimed: int = 0
    handed: int = Family(
        "ba_tasks_handed", "Of the attempts, tasks the ingest claimed for an idle worker."
    ).field()
    done: int = TASK_OUTCOMES.field(outcome="done")
    retried: int = TASK_OUTCOMES.field(outcome="retry")
    failed: int = TASK_OUTCOMES.field(outcome="failed")
    stale_commits: int = Family(
        "ba_stale_fence_refusals",
        "Commits the store refused (fence, owner,"
        " lease, deadline) and tasks not started after losing their lease.",
    ).field()
    cancelled: int = TASK_OUTCOMES.field(outcome="cancelled")
    timeouts: int = Family(
        "ba_handler_timeouts", "Handler calls abandoned (call timeout, stop grace)."
    ).field()
    expired: int = TASK_OUTCOMES.field(outcome="expired")
    renewals: int = Family("ba_lease_renewals", "Task lease renewals.").field()
    store_errors: int = Family(
        "ba_worker_store_errors", "Task outcomes whose commit failed (left to lease expiry)."
    ).field()
    #: not exported from here: ``ba_task_outcomes_total{outcome="unknown"}`` is counted by
    #: the database, the lease take-back's unknowns too
    unknown: int = 0
    waiting_approval: int = TASK_OUTCOMES.field(outcome="waiting_approval")


class WorkerMetricsSink(Protocol):
    """Where a worker's handler times and counters go (``app.metrics.WorkerMetrics``)."""

    def observe_call(self, elapsed_s: float, task: str = "") -> None: ...

    def sync(self, stats: WorkerStats, publish: DispatcherStats, takeovers: int) -> None: ...


#: The first claim of a worker takes at most this many tasks (no handler time known yet).
INITIAL_CLAIM = 4
#: Weight of the newest handler time in the running average that sizes claims.
HANDLER_TIME_WEIGHT = 0.2
