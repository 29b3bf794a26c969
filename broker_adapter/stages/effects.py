"""Declared side effects: what a handler registers, what happens after its call, and the
reconciler that finds out what an ``unknown`` task did.

A handler that reaches a system we do not commit with declares it (``side_effect``):

    @side_effect("restart_server", reconcile=server_restarted, compensate=undo_restart)
    def restart(task): ...

For such a handler (``irreversible``, or a call that marked its effect started) a timeout, a
crash or a lost lease after the start is never retried blindly: the task goes to ``unknown``
(``after_call``), and the reconciler (``Reconciler``) asks the registered reconcile
function, with the task and the effect's idempotency key (``EffectSpec.key``), what
happened (``after_reconcile``):

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

An action that ``requires_approval`` runs only while an approval record exists for its
action, target and scope (``ApprovalStore.valid_approval``, asked right before the effect);
without one the task waits in ``waiting_approval``.

The decisions (``after_call``, ``after_reconcile``) are pure functions; the ``Reconciler``
applies them through ``EffectsStore`` (approvals: ``ApprovalStore``), each in its own short
transaction, with the reconcile and compensation functions called between them
(``docs/RULES.md`` rule 9).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, TypeVar

from pydantic import Field

from broker_adapter.backoff import Backoff
from broker_adapter.config import ConfigModel, setting
from broker_adapter.errors import ConfigError, StaleError, TransientError
from broker_adapter.protocol.canonical import canonical_json, sha256_hex
from broker_adapter.protocol.idempotency import EFFECT_KEY_VERSION, Intent, effect_key
from broker_adapter.stages.calls import call_handler
from broker_adapter.stages.handlers import describe_error
from broker_adapter.stages.task import Task
from broker_adapter.store.approvals import Approval, ApprovalStore
from broker_adapter.store.cancel_reconcile import resolve_cancelled
from broker_adapter.store.effects import EffectsStore, ReconcileClaim
from broker_adapter.store.operator_waits import OperatorTimeoutAction, OperatorWaits
from broker_adapter.store.tasks import ClaimedTask

log = logging.getLogger("broker_adapter.effects")

#: ``ReconcilePolicy.operator_timeout_s`` by default: one day.
DEFAULT_OPERATOR_TIMEOUT_S = 24 * 3600.0

#: The compensation kind for an effect the target applied more than once.
DUPLICATE = "duplicate"
#: The compensation kind for the effect of a task whose cancel was requested.
CANCELLED = "cancelled"


@dataclass(frozen=True)
class Observation:
    """What a reconcile function found at the target.

    Attributes:
        outcome: ``done`` (the effect happened), ``not-done`` (it did not), ``unknown``.
        result: for ``done``, what the effect produced: the task's result (a JSON value).
        applied: for ``done``, how many times the target applied it (more than 1: a
            duplicate the target could not refuse, which the compensation undoes).
        note: a short text kept in the audit record.
    """

    outcome: Literal["done", "not-done", "unknown"]
    result: Any = None
    applied: int = 1
    note: str | None = None

    def __post_init__(self) -> None:
        if self.outcome not in ("done", "not-done", "unknown"):
            raise ValueError(f"outcome must be done, not-done or unknown, got {self.outcome!r}")
        if isinstance(self.applied, bool) or not isinstance(self.applied, int):
            raise ValueError(f"applied must be an integer, got {self.applied!r}")
        if self.outcome == "done" and self.applied < 1:
            raise ValueError(
                f"an effect that happened was applied at least once, not {self.applied}"
            )

    @classmethod
    def happened(
        cls, result: Any = None, *, applied: int = 1, note: str | None = None
    ) -> Observation:
        return cls("done", result, applied, note)

    @classmethod
    def not_happened(cls, note: str | None = None) -> Observation:
        return cls("not-done", note=note)

    @classmethod
    def still_unknown(cls, note: str | None = None) -> Observation:
        return cls("unknown", note=note)


#: Called with the task and the effect's idempotency key; says what the target did.
ReconcileFn = Callable[[ClaimedTask, str], Observation]
#: Called once for a duplicate effect, with the task and what the reconcile observed; what
#: it returns (a JSON value) is kept as the compensation's outcome detail.
CompensateFn = Callable[[ClaimedTask, Observation], Any]
#: The approval's ``(target, scope)`` for a task.
ApprovalFn = Callable[[ClaimedTask], tuple[str, str]]


@dataclass(frozen=True)
class EffectSpec:
    """What a handler declares about its external effect.

    Attributes:
        action: the effect's name (part of its idempotency key and of its approvals).
        irreversible: every call starts the effect (marked before the call); ``False``: a
            call marks it itself when it starts it.
        reconcile: finds out what an ``unknown`` task did (``None``: an operator does).
        compensate: undoes a duplicate, once (``None``: a duplicate is only recorded).
        compensate_cancelled: undoes the effect of a task cancelled after the effect
            happened, once (``None``: the effect stays, recorded as not undone).
        requires_approval: run only with a valid approval (``approval`` names it).
        approval: the approval's ``(target, scope)`` for a task.
        arguments: the effect's arguments for its key (default: the whole payload).
        version: the key's derivation (``protocol.idempotency``).
    """

    action: str
    irreversible: bool = True
    reconcile: ReconcileFn | None = None
    compensate: CompensateFn | None = None
    requires_approval: bool = False
    approval: ApprovalFn | None = None
    arguments: Callable[[ClaimedTask], Any] | None = None
    version: int = EFFECT_KEY_VERSION
    compensate_cancelled: CompensateFn | None = None

    def __post_init__(self) -> None:
        if not self.action:
            raise ConfigError("a side effect needs an action name")
        if self.requires_approval and self.approval is None:
            raise ConfigError(
                f"action {self.action!r} requires approval: give approval=(task -> (target, scope))"
            )

    def key(self, task: ClaimedTask) -> str:
        """The idempotency key of this effect for ``task`` (the same in every attempt)."""
        arguments = self.arguments_of(task)
        intent = Intent(task.principal, task.message_id)
        return effect_key(intent, self.action, arguments, version=self.version)

    def arguments_of(self, task: ClaimedTask) -> Any:
        """The effect's arguments for ``task`` (``arguments``; default: the payload)."""
        return task.payload if self.arguments is None else self.arguments(task)

    def approval_digest(self, task: ClaimedTask) -> str:
        """What an approval of ``task`` is bound to besides its principal:
        ``arguments_digest`` of this action, its arguments for ``task`` and the version."""
        return arguments_digest(self.action, self.arguments_of(task), self.version)

    def approval_of(self, task: ClaimedTask) -> tuple[str, str]:
        """The ``(target, scope)`` an approval of ``task`` must name."""
        if self.approval is None:
            raise ConfigError(f"action {self.action!r} has no approval target")
        return self.approval(task)


def arguments_digest(action: str, arguments: Any, version: int = EFFECT_KEY_VERSION) -> str:
    """SHA-256 (hex) of the canonical JSON of ``{"action", "arguments", "version"}``: what
    an approval allows, besides its target, scope and requesting principal. The approver
    is shown it with the arguments (``broker-adapter approve --task``); a task whose
    effect has other arguments, or another key version, does not run under it.

    Raises:
        ValueError: ``arguments`` is not JSON (NaN, a set, ...).
    """
    body = canonical_json({"action": action, "arguments": arguments, "version": version})
    return sha256_hex(body)


H = TypeVar("H", bound=Callable[..., Any])
_SPEC_ATTR = "__ba_side_effect__"


def side_effect(
    action: str,
    *,
    irreversible: bool = True,
    reconcile: ReconcileFn | None = None,
    compensate: CompensateFn | None = None,
    requires_approval: bool = False,
    approval: ApprovalFn | None = None,
    arguments: Callable[[ClaimedTask], Any] | None = None,
    version: int = EFFECT_KEY_VERSION,
    compensate_cancelled: CompensateFn | None = None,
) -> Callable[[H], H]:
    """Declare a handler's external effect (see ``EffectSpec``); the handler is returned
    as it is, with the declaration attached (``effect_spec`` reads it)."""
    spec = EffectSpec(
        action,
        irreversible,
        reconcile,
        compensate,
        requires_approval,
        approval,
        arguments,
        version,
        compensate_cancelled,
    )

    def register(handler: H) -> H:
        setattr(handler, _SPEC_ATTR, spec)
        return handler

    return register


def effect_spec(handler: Callable[..., Any]) -> EffectSpec | None:
    """The declaration ``side_effect`` attached to ``handler``, or ``None``."""
    spec = getattr(handler, _SPEC_ATTR, None)
    return spec if isinstance(spec, EffectSpec) else None


# -- decisions ------------------------------------------------------------------------------


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
class Step:
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
) -> Step:
    """The step after a reconcile that observed ``seen``, ``tries`` reconciles having found
    nothing before it."""
    if seen.outcome == "done":
        return Step("done", compensate=seen.applied > 1)
    if seen.outcome == "not-done":
        return Step("retry")
    tries += 1
    if tries >= policy.max_tries:
        return Step("operator")
    return Step("back_off", retry_at=now + policy.backoff.delay(tries, rng))


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
            step = Step("operator")
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


# -- approvals ------------------------------------------------------------------------------


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


def run_reconciles(
    stop: threading.Event,
    reconciler: Reconciler,
    approvals: ApprovalStore,
    logger: logging.Logger | None = None,
) -> None:
    """Until ``stop``: release the approval waits (``ApprovalStore.release_waits``) and
    reconcile a batch of ``unknown`` tasks (``Reconciler.run_once``), every
    ``policy.every_s`` (at once again while batches come back full). A store that is busy
    or failing is tried again at the next pass."""
    out = logger or log
    while not stop.is_set():
        full = False
        try:
            approvals.release_waits()
            full = reconciler.run_once() >= reconciler.policy.batch
        except TransientError as exc:
            out.warning("reconcile pass failed, will retry: %s", exc)
        if not full and stop.wait(reconciler.policy.every_s):
            return
