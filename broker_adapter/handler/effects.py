"""Declared side effects: what a handler registers about an effect on a system we do not
commit with, and what a reconcile function answers about it.

    @side_effect("restart_server", reconcile=server_restarted, compensate=undo_restart)
    def restart(task): ...

For such a handler (``irreversible``, or a call that marked its effect started) a timeout, a
crash or a lost lease after the start is never retried blindly: the task goes to ``unknown``
and the reconciler (``stages.reconcile``) asks the registered reconcile function, with the
task and the effect's idempotency key (``EffectSpec.key``), what happened: an
``Observation``. An effect that the target applied more than once is undone by
``compensate``, once; the effect of a task cancelled after it started by
``compensate_cancelled``.

An action that ``requires_approval`` runs only while an approval record exists for its
action, target and scope, bound to the task's principal and to ``arguments_digest`` of its
arguments; without one the task waits in ``waiting_approval``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from broker_adapter.errors import ConfigError
from broker_adapter.protocol.canonical import canonical_json, sha256_hex
from broker_adapter.protocol.idempotency import EFFECT_KEY_VERSION, Intent, action_key
from broker_adapter.store.task_types import ClaimedTask


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
        return action_key(intent, self.action, arguments, version=self.version)

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
