"""The worker's side of a declared side effect (``handler.effects.side_effect``): what happens right
before the handler's call and right after it.

Before the call (on the call thread, no transaction held): an action that
``requires_approval`` takes a use of a matching approval record (``current_approval``:
asked now, so a record revoked, expired or used up since the claim stops it; it must name
the task's principal and the digest of its effect's arguments; nothing in the payload
counts); without a valid one the task is parked in ``waiting_approval``
(``hold_for_approval``) and its handler does not run. An ``irreversible`` effect is then
marked started (``EffectsStore.mark_effect_started``), which also refuses a task whose
cancel was requested. A handler declared ``irreversible=False`` marks it itself, per call
(``Task.effect_started()``).

After the call: ``after_call`` decides. A timeout, a stop past the grace, or an
error asking for a retry after the effect started goes to ``unknown``
(``EffectsStore.to_unknown``, its own short transaction) for the reconcile, never to a
blind retry; everything else is settled with the batch as usual. An ordinary handler
(no declaration) never reaches this module: the worker's cost for it is one ``None`` check.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from functools import partial

from broker_adapter.errors import StaleError, TaskCancelled
from broker_adapter.handler.effects import EffectSpec
from broker_adapter.handler.task import Task, TaskControl
from broker_adapter.protocol.canonical import canonical_json
from broker_adapter.stages.shared.calls import CallOutcome
from broker_adapter.stages.shared.handlers import describe_error, is_retryable
from broker_adapter.stages.worker.config import WorkerStats
from broker_adapter.stages.worker.lease import Leases
from broker_adapter.store import transitions
from broker_adapter.store.approvals import Approval, ApprovalStore
from broker_adapter.store.effects import EffectsStore
from broker_adapter.store.evidence import key_digest
from broker_adapter.store.task_types import ClaimedTask
from broker_adapter.store.tasks import TaskStore


class CallEnd(StrEnum):
    """How a handler call ended, as the worker saw it."""

    RETURNED = "returned"
    RAISED = "raised"
    TIMED_OUT = "timed_out"
    STOPPED = "stopped"  # the worker stopped past its grace
    LEASE_LOST = "lease_lost"


class AfterCall(StrEnum):
    """What the worker writes after a call."""

    SETTLE = "settle"  # as without a declared effect: done, or fail (retried per budget)
    UNKNOWN = "unknown"  # EffectsStore.to_unknown: the reconcile decides
    NOTHING = "nothing"  # no claim left to write with: the store's take-back decides


def after_call(end: CallEnd, *, effect_started: bool, retryable: bool = False) -> AfterCall:
    """The worker's next write after a call.

    A call that returned is settled. A lost lease leaves nothing to write (the commit would
    be refused; the store sends an effect-started task to ``unknown`` when it takes the
    lease back). Before the effect started, everything is settled as usual (a retry cannot
    repeat an effect that never began). After it, a non-retryable error fails the task (no
    second call follows), while a timeout, a stop or an error asking for a retry would
    retry blindly: ``unknown``.
    """
    if end is CallEnd.RETURNED:
        return AfterCall.SETTLE
    if end is CallEnd.LEASE_LOST:
        return AfterCall.NOTHING
    if not effect_started or (end is CallEnd.RAISED and not retryable):
        return AfterCall.SETTLE
    return AfterCall.UNKNOWN


def current_approval(
    approvals: ApprovalStore, spec: EffectSpec, task: ClaimedTask
) -> Approval | None:
    """The approval that lets ``task`` (of an effect that ``requires_approval``) run its
    effect now, one of its uses taken for ``task`` (``ApprovalStore.use_approval``), or
    ``None``. Ask right before the effect: a record revoked, expired or used up since the
    claim stops it. It must name ``task``'s principal and the digest of its arguments
    (``EffectSpec.approval_digest``); nothing in the task's payload counts.

    Raises:
        StaleError: the caller no longer holds ``task``.
    """
    target, scope = spec.approval_of(task)
    return approvals.use_approval(
        task.task_id,
        task.owner,
        task.fence,
        spec.action,
        target,
        scope,
        principal=task.principal,
        arguments_digest=spec.approval_digest(task),
    )


def hold_for_approval(
    approvals: ApprovalStore, spec: EffectSpec, task: ClaimedTask, timeout_s: float
) -> float:
    """Park ``task`` in ``waiting_approval`` for its approval (its holder found none).
    Returns when the wait ends without one."""
    target, scope = spec.approval_of(task)
    arguments = spec.arguments_of(task)
    return approvals.wait_for_approval(
        task.task_id,
        task.owner,
        task.fence,
        spec.action,
        target,
        scope,
        timeout_s,
        principal=task.principal,
        arguments_digest=spec.approval_digest(task),
        arguments=canonical_json(arguments).decode("utf-8"),
    )


def call_end(task: Task, outcome: CallOutcome) -> CallEnd:
    """How a call ended, as ``after_call`` takes it."""
    if outcome.ok:
        return CallEnd.RETURNED
    if task.stop_reason == "lease_lost":
        return CallEnd.LEASE_LOST
    if outcome.timed_out:
        return CallEnd.TIMED_OUT
    if outcome.stopped:
        return CallEnd.STOPPED
    return CallEnd.RAISED


def stopped_how(task: Task, outcome: CallOutcome) -> str:
    """What is known of a call that stopped on a cancel, for the task's reply."""
    if outcome.timed_out:
        how = "the handler timed out"
    elif outcome.stopped:
        how = "the worker stopped past its grace"
    elif outcome.error is not None:
        how = f"the handler raised {describe_error(outcome.error)}"
    else:
        how = "the handler returned"
    if task.effect_was_started:
        return f"{how}; its effect had started: what it did stays"
    if task.declares_effect:
        return f"{how}; its effect had not started"
    return f"{how}; any effect it caused stays"


class EffectGate:
    """Approvals and effect marks around the calls of one declared handler.

    Args:
        tasks: the store.
        spec: the handler's declaration.
        leases: the worker's leases (a parked or refused task's lease is let go).
        approval_timeout_s: how long a task waits for its approval before it ends.
        stats: the worker's counters (``unknown``, ``waiting_approval``, ...).
        log: where refusals are reported.
    """

    def __init__(
        self,
        tasks: TaskStore,
        spec: EffectSpec,
        leases: Leases,
        approval_timeout_s: float,
        stats: WorkerStats,
        log: logging.Logger,
    ) -> None:
        self.tasks = tasks
        self.spec = spec
        self.effects = EffectsStore(tasks.tx)
        self.approvals = ApprovalStore(tasks.tx)
        self.leases = leases
        self.approval_timeout_s = approval_timeout_s
        self.stats = stats
        self.log = log

    def before_call(self, task: Task) -> bool:
        """Right before the handler: whether it may run (approved, effect marked)."""
        claimed = task.claimed
        spec = self.spec
        try:
            approved = (
                not spec.requires_approval
                or current_approval(self.approvals, spec, claimed) is not None
            )
        except StaleError as exc:
            self.leases.release(claimed.task_id)
            self._refused(task, exc)
            return False
        if not approved:
            self.leases.release(claimed.task_id)
            try:
                until = hold_for_approval(self.approvals, spec, claimed, self.approval_timeout_s)
            except StaleError as exc:
                self._refused(task, exc)
                return False
            self.stats.waiting_approval += 1
            transitions.claim_transition(
                "waiting_approval",
                claimed,
                "waiting_approval",
                detail=f"no valid approval of {spec.action!r}; waits until {until:.3f}",
            )
            return False
        start = partial(
            self.effects.mark_effect_started,
            claimed.task_id,
            claimed.owner,
            claimed.fence,
            key_digest=self._key_digest(claimed),
        )
        control = TaskControl(task)
        if not spec.irreversible:
            control.allow_effect(start)
            return True
        try:
            start()
        except StaleError as exc:
            self.leases.release(claimed.task_id)
            self._refused(task, exc)
            return False
        control.note_effect_started()
        return True

    def _key_digest(self, claimed: ClaimedTask) -> str | None:
        """The digest of the effect's key for the task's records (``None`` when its
        arguments cannot make one: the effect's own call reports that)."""
        try:
            return key_digest(self.spec.key(claimed))
        except (ValueError, TypeError, KeyError) as exc:
            self.log.warning("task %s: no effect key digest: %s", claimed.task_id, exc)
            return None

    def _refused(self, task: Task, exc: StaleError) -> None:
        """The store refused the mark or the wait: a requested cancel ends the task now
        (nothing was started), a lost claim is left to its new holder."""
        claimed = task.claimed
        if isinstance(exc, TaskCancelled):
            self.tasks.cancel(claimed.task_id, "cancelled before its effect started")
            self.stats.cancelled += 1
            return
        self.stats.stale_commits += 1
        self.log.warning("task %s not started, its claim is gone: %s", claimed.task_id, exc)

    def after_call(self, task: Task, outcome: CallOutcome) -> bool:
        """After the call: True when this wrote the outcome (``unknown``) or there is none
        to write; False: settle it with the batch."""
        if not task.effect_was_started:
            return False
        retryable = outcome.error is not None and is_retryable(outcome.error)
        decision = after_call(call_end(task, outcome), effect_started=True, retryable=retryable)
        cancel = task.stop_reason == "cancelled" and not outcome.ok
        if cancel:
            decision = AfterCall.UNKNOWN
        if decision is AfterCall.SETTLE:
            return False
        if decision is AfterCall.NOTHING:
            self.stats.stale_commits += 1
            return True
        claimed = task.claimed
        if cancel:
            # Rule 11: the cancel cannot undo what started; the reconcile finds out and
            # ends it ``cancelled`` (``cancel_reconcile``), undoing a happened effect.
            reason = "cancel requested after the effect started; the reconcile decides"
        elif outcome.timed_out:
            reason = "timeout after the effect started"
        elif outcome.stopped:
            reason = "worker stopped after the effect started"
        else:
            assert outcome.error is not None
            reason = f"{describe_error(outcome.error)} (after the effect started)"
        try:
            self.effects.to_unknown(claimed.task_id, claimed.owner, claimed.fence, reason)
        except TaskCancelled:  # cancelled outright meanwhile: nothing left to write
            self.stats.cancelled += 1
            return True
        except StaleError as exc:  # its lease lapsed: the store's take-back sends it there
            self.stats.stale_commits += 1
            self.log.warning("task %s: unknown refused: %s", claimed.task_id, exc)
            return True
        self.stats.unknown += 1
        transitions.claim_transition("unknown", claimed, "unknown", detail=reason)
        return True
