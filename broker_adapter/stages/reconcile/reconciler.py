"""The reconciler: finds out what an ``unknown`` task's declared side effect did
(``handler.effects``), and ends the task, lets it run again, or leaves it to an operator.

A task goes to ``unknown`` when a call of a handler declared with ``side_effect`` ended
after its effect started without a result the worker may settle (a timeout, a crash, a
lost lease; ``stages.worker.effect_gate``). The ``Reconciler`` asks the registered
reconcile function, with the task and the effect's idempotency key (``EffectSpec.key``),
what happened (``after_reconcile``):

* it happened: ``done``, with the result it observed; if the target applied it more than
  once (a duplicate it could not refuse), the compensation runs once, under its own record;
* it did not: ``pending``, the attempt may run again;
* still unknown: the task stays ``unknown`` and is asked again later (backoff), and after
  ``ReconcilePolicy.max_tries`` it waits for an operator (``broker-adapter reconcile``),
  for ``ReconcilePolicy.operator_timeout_s`` at most: then an alert, or (``fail``) the task
  ends ``failed``, its reply saying the effect's outcome is unknown
  (``store.operator_waits``).

A task whose cancel was requested after its effect started goes to ``unknown`` too (the
cancel cannot undo what happened): its reconcile ends it ``cancelled``, and when the effect
did happen, the registered ``compensate_cancelled`` undoes it once, under its own record
(kind ``cancelled``).

Between two passes, ``run_reconciles`` also releases the approval waits that ended
(``ApprovalStore.release_waits``).

The decision (``after_reconcile``) is a pure function; the ``Reconciler`` applies it
through ``EffectsStore``, each step in its own short transaction, with the reconcile and
compensation functions called between them (``docs/RULES.md`` rule 9).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field

from broker_adapter.backoff import Backoff
from broker_adapter.config import ConfigModel, setting
from broker_adapter.errors import StaleError
from broker_adapter.handler.effects import CompensateFn, EffectSpec, Observation
from broker_adapter.handler.task import Task
from broker_adapter.protocol.canonical import canonical_json
from broker_adapter.stages.shared.calls import call_handler
from broker_adapter.stages.shared.handlers import describe_error
from broker_adapter.stages.shared.loop import run_stage
from broker_adapter.store.approvals import ApprovalStore
from broker_adapter.store.cancel_reconcile import resolve_cancelled
from broker_adapter.store.effects import EffectsStore, ReconcileClaim
from broker_adapter.store.operator_waits import OperatorTimeoutAction, OperatorWaits
from broker_adapter.store.task_types import ClaimedTask

log = logging.getLogger("broker_adapter.effects")

#: ``ReconcilePolicy.operator_timeout_s`` by default: one day.
DEFAULT_OPERATOR_TIMEOUT_S = 24 * 3600.0

#: The compensation kind for an effect the target applied more than once.
DUPLICATE = "duplicate"
#: The compensation kind for the effect of a task whose cancel was requested.
CANCELLED = "cancelled"


class ReconcilePolicy(ConfigModel):
    """How the reconciler works.

    Attributes:
        lease_s: the lease on an ``unknown`` task while its reconcile runs.
        batch: tasks held per pass at most.
        max_tries: reconciles that find nothing before the task waits for an operator.
        backoff: delay before the next reconcile of a task still unknown.
        call_timeout_s: a reconcile function that has not answered by then knows nothing
            (``unknown``); kept below ``lease_s`` so its answer is written under its lease.
        every_s: the pause between two passes of ``run_reconciles``.
        operator_timeout_s: how long a task may wait for an operator; past it the
            reconciler raises the alert (``ba_operator_waits_overdue``) or ends it.
        operator_timeout_action: ``alert`` (it keeps waiting, marked overdue) or ``fail``
            (``failed``, its reply saying the effect's outcome is unknown).
    """

    lease_s: float = Field(default=60.0, gt=0)
    call_timeout_s: float = Field(default=20.0, gt=0)
    every_s: float = Field(default=1.0, gt=0)
    batch: int = Field(default=16, ge=1)
    max_tries: int = Field(default=8, ge=1)
    backoff: Backoff = Field(default_factory=lambda: Backoff(base_s=5.0, cap_s=600.0))
    operator_timeout_s: float = setting(
        DEFAULT_OPERATOR_TIMEOUT_S,
        gt=0,
        help="a task whose effect's outcome is unknown waits this long for an operator's"
        " answer, seconds; then the alert, or the action below",
        flag="--operator-timeout",
        env="BA_OPERATOR_TIMEOUT_S",
        metavar="S",
    )
    operator_timeout_action: OperatorTimeoutAction = setting(
        "alert",
        help="past --operator-timeout: alert (it keeps waiting, marked overdue) or fail (it"
        " ends failed, its reply saying the effect's outcome is unknown)",
        flag="--operator-timeout-action",
        env="BA_OPERATOR_TIMEOUT_ACTION",
    )


@dataclass(frozen=True)
class ReconcileStep:
    """What to do with an ``unknown`` task after one reconcile.

    Attributes:
        kind: ``done``, ``retry`` (back to pending), ``back_off`` (ask again at
            ``retry_at``) or ``operator`` (wait for one).
        retry_at: for ``back_off``.
        compensate: for ``done``: the effect was applied more than once.
    """

    kind: Literal["done", "retry", "back_off", "operator"]
    retry_at: float | None = None
    compensate: bool = False


def after_reconcile(
    seen: Observation,
    tries: int,
    policy: ReconcilePolicy,
    now: float,
    rng: random.Random | None = None,
) -> ReconcileStep:
    """The step after a reconcile that observed ``seen``, ``tries`` reconciles having found
    nothing before it."""
    if seen.outcome == "done":
        return ReconcileStep("done", compensate=seen.applied > 1)
    if seen.outcome == "not-done":
        return ReconcileStep("retry")
    tries += 1
    if tries >= policy.max_tries:
        return ReconcileStep("operator")
    return ReconcileStep("back_off", retry_at=now + policy.backoff.delay(tries, rng))


# -- the reconciler -------------------------------------------------------------------------


@dataclass
class ReconcileStats:
    done: int = 0
    not_done: int = 0
    unknown: int = 0
    operator: int = 0
    compensations: int = 0
    stale: int = 0
    operator_timeouts: int = 0
    outcomes: list[tuple[str, str]] = field(default_factory=list)  # (task_id, step kind)


class Reconciler:
    """Reconciles the ``unknown`` tasks of one declared effect, a batch per ``run_once``.

    Args:
        effects: the store.
        spec: the effect (its reconcile and compensation functions).
        owner: the reconciler's name (its claims and audit records carry it).
        by_task: the effects of a ``Router``'s tasks, by task name: a task's own is used
            for it, ``spec`` for a name not in it.
        policy: lease, batch, tries, backoff.
        rng: randomness for the backoff's jitter.
    """

    def __init__(
        self,
        effects: EffectsStore,
        spec: EffectSpec,
        owner: str,
        policy: ReconcilePolicy | None = None,
        rng: random.Random | None = None,
        by_task: Mapping[str | None, EffectSpec] | None = None,
    ) -> None:
        self.effects = effects
        self.spec = spec
        self.by_task = dict(by_task or {})
        self.owner = owner
        self.policy = policy or ReconcilePolicy()
        self.rng = rng or random.Random()
        self.stats = ReconcileStats()

    def run_once(self) -> int:
        """Bound the operator waits (``bound_operator_waits``), then hold a batch of due
        ``unknown`` tasks and reconcile each. Returns how many were reconciled."""
        self.bound_operator_waits()
        claims = self.effects.claim_unknown(self.owner, self.policy.batch, self.policy.lease_s)
        for claim in claims:
            try:
                kind = self._one(claim)
            except StaleError as exc:  # the reconcile's lease lapsed, or an operator answered
                log.warning("reconcile of %s refused: %s", claim.task.task_id, exc)
                self.stats.stale += 1
                kind = "stale"
            self.stats.outcomes.append((claim.task.task_id, kind))
        return len(claims)

    def bound_operator_waits(self) -> list[str]:
        """Apply ``operator_timeout_action`` to the tasks waiting for an operator longer
        than ``operator_timeout_s`` (``OperatorWaits.bound_waits``). Returns their ids."""
        policy = self.policy
        bounded = OperatorWaits(self.effects).bound_waits(
            policy.operator_timeout_s, policy.operator_timeout_action, self.owner
        )
        for task_id in bounded:
            log.warning(
                "task %s waited for an operator over %g s: %s",
                task_id,
                policy.operator_timeout_s,
                "alert raised"
                if policy.operator_timeout_action == "alert"
                else "ended failed, its effect's outcome unknown",
            )
        self.stats.operator_timeouts += len(bounded)
        return bounded

    def observe(self, task: ClaimedTask) -> Observation:
        """The reconcile function's answer; one that raises or answers nonsense is
        ``unknown`` (never a guess)."""
        spec = self.spec_of(task)
        if spec.reconcile is None:
            return Observation.still_unknown("no reconcile function: an operator decides")
        reconcile, key = spec.reconcile, spec.key(task)
        timeout_s = min(self.policy.call_timeout_s, self.policy.lease_s)
        ended = call_handler(lambda _t: reconcile(task, key), Task(task), timeout_s)
        if ended.timed_out:
            return Observation.still_unknown(f"reconcile gave no answer within {timeout_s} s")
        if ended.error is not None:  # a failed reconcile knows nothing
            return Observation.still_unknown(f"reconcile raised {describe_error(ended.error)}")
        seen = ended.value
        if not isinstance(seen, Observation):
            return Observation.still_unknown(f"reconcile returned {type(seen).__name__}")
        return seen

    def spec_of(self, task: ClaimedTask) -> EffectSpec:
        """The effect ``task``'s handler declared (``by_task``, else ``spec``)."""
        return self.by_task.get(task.task_name, self.spec)

    def _one(self, claim: ReconcileClaim) -> str:
        task = claim.task
        seen = self.observe(task)
        step = after_reconcile(seen, claim.tries, self.policy, self.effects.clock.now(), self.rng)
        if self.spec_of(task).reconcile is None:
            step = ReconcileStep("operator")
        args = (task.task_id, self.owner, task.fence)
        if step.kind in ("done", "retry") and self.effects.cancel_requested(task.task_id):
            if seen.outcome == "done":  # the cancel came too late: undo what happened
                what = f"cancelled; the effect was applied {seen.applied} times"
                undo = self.spec_of(task).compensate_cancelled
                self._compensate(task, seen, CANCELLED, undo, what)
            resolve_cancelled(self.effects, *args, seen.outcome, seen.result, note=seen.note)
            self.stats.done += seen.outcome == "done"
            self.stats.not_done += seen.outcome != "done"
            return "cancelled"
        if step.kind == "done":
            if step.compensate:
                self._compensate(
                    task,
                    seen,
                    DUPLICATE,
                    self.spec_of(task).compensate,
                    f"the effect was applied {seen.applied} times",
                )
            self.effects.resolve_done(*args, seen.result, note=seen.note)
            self.stats.done += 1
        elif step.kind == "retry":
            self.effects.resolve_not_done(*args, note=seen.note)
            self.stats.not_done += 1
        else:
            self.effects.resolve_unknown(*args, step.retry_at, note=seen.note)
            if step.kind == "operator":
                self.stats.operator += 1
            else:
                self.stats.unknown += 1
        return step.kind

    def _compensate(
        self,
        task: ClaimedTask,
        seen: Observation,
        kind: str,
        undo: CompensateFn | None,
        what: str,
    ) -> None:
        """Run compensation ``kind`` (``DUPLICATE``, ``CANCELLED``) once: begun under its
        record (a second reconcile of the task finds it begun and does not run it again),
        ended with how it went."""
        if undo is None:
            what += "; no compensation registered"
        if not self.effects.begin_compensation(task.task_id, kind, self.owner, task.fence, what):
            return
        if undo is None:
            self.effects.end_compensation(task.task_id, kind, "failed", "none registered")
            return
        self.stats.compensations += 1
        try:
            detail = undo(task, seen)
        except Exception as exc:  # noqa: BLE001 - recorded as the compensation's outcome
            self.effects.end_compensation(task.task_id, kind, "failed", describe_error(exc))
            return
        try:
            text = canonical_json(detail).decode("utf-8")
        except ValueError:
            text = repr(detail)
        self.effects.end_compensation(task.task_id, kind, "done", text)


def run_reconciles(
    stop: threading.Event,
    reconciler: Reconciler,
    approvals: ApprovalStore,
    logger: logging.Logger | None = None,
) -> None:
    """Until ``stop`` (``loop.run_stage``): release the approval waits
    (``ApprovalStore.release_waits``) and reconcile a batch of ``unknown`` tasks
    (``Reconciler.run_once``), every ``policy.every_s`` (at once again while batches come
    back full). A store that is busy or failing is tried again after a backoff."""

    def one_pass() -> bool:
        approvals.release_waits()
        return reconciler.run_once() >= reconciler.policy.batch  # full: more may wait

    every_s = reconciler.policy.every_s
    run_stage(
        stop, one_pass, log=logger or log, what="reconcile pass", wait=lambda: stop.wait(every_s)
    )
