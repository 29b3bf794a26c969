"""What a worker checks before a claimed task's handler starts, and how it ends a task whose
cancel was requested while it ran (``docs/RULES.md`` rule 11).

Before the start: a task cancelled, or whose lease was lost while it waited its turn in
the batch, does not start (its lease is let go; a lost lease counts as a stale commit); a
task whose deadline passed first goes to ``expired`` through the store's reconcile; a
declared side effect asks its gate (``effect_gate.EffectGate``: approval, effect mark).
Otherwise the call's timeout is the smaller of the worker's ``call_timeout_s`` and the time
left to the deadline.
"""

from __future__ import annotations

import logging
from typing import Literal

from broker_adapter import crashpoints
from broker_adapter.clock import Clock
from broker_adapter.errors import TransientError
from broker_adapter.handler.task import Task
from broker_adapter.stages.worker.config import WorkerStats
from broker_adapter.stages.worker.effect_gate import EffectGate
from broker_adapter.stages.worker.lease import Leases
from broker_adapter.store import transitions
from broker_adapter.store.effects import EffectsStore
from broker_adapter.store.task_types import ClaimedTask
from broker_adapter.store.tasks import TaskStore


class TaskStart:
    """The start checks of one worker (``Worker._prepare`` asks ``prepare``)."""

    def __init__(
        self,
        tasks: TaskStore,
        leases: Leases,
        clock: Clock,
        stats: WorkerStats,
        log: logging.Logger,
        call_timeout_s: float,
        effects: EffectGate | None,
    ) -> None:
        self.tasks = tasks
        self.leases = leases
        self.clock = clock
        self.stats = stats
        self.log = log
        self.call_timeout_s = call_timeout_s
        self.effects = effects
        #: Ends requested cancels (made when one is first needed).
        self._cancels: EffectsStore | None = None

    def prepare(
        self,
        task: Task,
        *,
        gate: EffectGate | Literal[False] | None = False,
        call_timeout_s: float | None = None,
    ) -> float | None:
        """The handler call's timeout, or ``None`` when the task is not to run (cancelled,
        lease lost while it waited its turn, deadline passed first, or held by its effect's
        gate).

        Args:
            gate: the effect gate of the task's handler (``False``: ``self.effects``).
            call_timeout_s: the task's own call timeout (``None``: ``self.call_timeout_s``).
        """
        effects = self.effects if gate is False else gate
        claimed = task.claimed
        crashpoints.hit("worker.after_claim")
        if task.cancelled():
            self.leases.release(claimed.task_id)
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
            self.end_cancel(claimed, "its handler had not started")
            transitions.claim_transition("cancelled", claimed, "cancelled", detail="not started")
            return None
        time_left_s = claimed.deadline - self.clock.now()
        if time_left_s <= 0:
            # Reconcile moves it to ``expired`` with its reply; running it would be refused.
            self.leases.release(claimed.task_id)
            self.tasks.reconcile()
            self.stats.expired += 1
            transitions.claim_transition("expired", claimed, "expired", detail="not started")
            return None
        if effects is not None and not effects.before_call(task):
            return None  # parked for its approval, or refused: the handler does not run
        limit = self.call_timeout_s if call_timeout_s is None else call_timeout_s
        return min(limit, time_left_s)

    def end_cancel(self, claimed: ClaimedTask, what: str) -> None:
        """End a running task whose cancel was requested (``EffectsStore.request_cancel``)
        as ``cancelled``, its reply saying ``what`` happened; nothing when it was cancelled
        outright (``TaskStore.cancel``: already terminal)."""
        if self._cancels is None:
            self._cancels = EffectsStore(self.tasks.tx)
        try:
            self._cancels.end_requested_cancel(claimed.task_id, claimed.owner, claimed.fence, what)
        except TransientError as exc:  # the lease lapses: the take-back ends it cancelled
            self.log.warning("ending the cancel of %s failed: %s", claimed.task_id, exc)
