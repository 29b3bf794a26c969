"""One log line per task transition, with the task's ids as structured fields.

Every line goes to the logger ``broker_adapter.tasks`` with the fields as attributes of
the record (logging's ``extra=``): ``transition``, ``task_id``, ``state`` (after it) and,
when known, ``message_id``, ``principal``, ``reply_id``, ``owner``, ``fence``,
``attempt``, ``duration_s`` and ``detail``. ``broker_adapter.app.logs`` renders them as
``key=value`` (text) or as members of the line's object (JSON). A payload, a result or a
secret is never a field.

Levels: the transitions every task makes on its way (``accepted``, ``claimed``, ``done``)
are DEBUG, the others INFO: ``retry``, ``failed``, ``cancelled``, ``expired``,
``hop_limit``, ``lease_expired`` (back to pending after its holder's lease ran out),
``stale`` (a commit the store refused: fence, owner, lease, deadline), and the inbox's
``duplicate`` and ``conflict`` (no transition: the request was there already). At the
CLI's default level an operator sees every task that left the happy path and pays
nothing per task on it (three records per task would cost about a third of the
end-to-end throughput); ``-v`` shows every transition. A reply that goes dead is the
dispatcher's ERROR line, with ``reply_fields`` (``transition`` ``reply_dead``).

Each call site logs after its transaction committed (a rolled-back transaction logs
nothing), and builds no record unless the logger is enabled for it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from broker_adapter.errors import StaleError, TaskCancelled
from broker_adapter.protocol.reply import reply_id_for
from broker_adapter.store.task_types import Reconciled

if TYPE_CHECKING:
    from broker_adapter.store.inbox import AcceptItem, AcceptResult

log = logging.getLogger("broker_adapter.tasks")

#: The transitions every task makes: DEBUG. The others are INFO.
ROUTINE = frozenset({"accepted", "claimed", "done"})


_ACCEPT_TRANSITION = {
    "stored": ("accepted", "pending"),
    "expired": ("expired", "expired"),
    "hop_limit": ("hop_limit", "hop_limit"),
    "duplicate": ("duplicate", None),
    "conflict": ("conflict", None),
}


class Claim(Protocol):
    """What a line needs of a claimed task (``task_types.ClaimedTask``)."""

    @property
    def task_id(self) -> str: ...
    @property
    def message_id(self) -> str: ...
    @property
    def principal(self) -> str: ...
    @property
    def owner(self) -> str: ...
    @property
    def fence(self) -> int: ...
    @property
    def attempt(self) -> int: ...


def level_of(transition: str) -> int:
    return logging.DEBUG if transition in ROUTINE else logging.INFO


def enabled(transition: str = "retry") -> bool:
    """Whether a line of ``transition`` would be logged (default: any non-routine one)."""
    return log.isEnabledFor(level_of(transition))


def task_transition(transition: str, task_id: str, state: str | None, **fields: Any) -> None:
    """Log one transition; ``fields`` with the value ``None`` are left out."""
    level = level_of(transition)
    if not log.isEnabledFor(level):
        return
    extra = {"transition": transition, "task_id": task_id}
    if state is not None:
        extra["state"] = state
    extra.update((k, v) for k, v in fields.items() if v is not None)
    log.log(level, "task %s %s", task_id, transition, extra=extra)


def claim_fields(claim: Claim) -> dict[str, Any]:
    """The ids of a claimed task, for a transition line or another record's ``extra``."""
    return {
        "task_id": claim.task_id,
        "message_id": claim.message_id,
        "principal": claim.principal,
        "reply_id": reply_id_for(claim.task_id),
        "owner": claim.owner,
        "fence": claim.fence,
        "attempt": claim.attempt,
    }


def claimed(claims: Iterable[Claim], how: str = "claim") -> None:
    """Tasks a worker holds now (pending -> running); ``how``: its own claim, or handed by
    the ingest (``handoff``)."""
    if not enabled("claimed"):
        return
    for c in claims:
        fields = claim_fields(c)
        task_transition("claimed", fields.pop("task_id"), "running", detail=how, **fields)


def claim_transition(
    transition: str,
    claim: Claim,
    state: str | None,
    *,
    duration_s: float | None = None,
    detail: str | None = None,
) -> None:
    """A transition of a task this worker held (done, retry, failed, cancelled, expired,
    stale)."""
    if not enabled(transition):
        return
    fields = claim_fields(claim)
    if duration_s is not None:
        fields["duration_s"] = round(duration_s, 6)
    task_transition(transition, fields.pop("task_id"), state, detail=detail, **fields)


def accepted(items: Sequence[AcceptItem], results: Sequence[AcceptResult]) -> None:
    """What the inbox did with each authenticated entry of a committed batch."""
    routine = enabled("accepted")
    if not routine and not enabled():
        return
    for item, result in zip(items, results, strict=True):
        if not routine and result.outcome == "stored":
            continue  # the common case costs one look
        known = _ACCEPT_TRANSITION.get(result.outcome.value)
        if known is None or result.task_id is None:
            continue
        transition, state = known
        task_transition(
            transition,
            result.task_id,
            state,
            message_id=item.envelope.message_id,
            principal=item.principal,
            reply_id=result.reply_id or reply_id_for(result.task_id),
        )


def reconciled(taken_back: Iterable[Reconciled]) -> None:
    """The transitions the clock made: ``(task_id, transition, state, owner, attempts)``
    for a deadline reached (``expired``), a lease run out (``lease_expired``, back to
    pending) or run out on the last attempt (``failed``), an attempt whose effect started
    (``unknown``), and a requested cancel whose handler did not end (``cancelled``)."""
    if not enabled():
        return
    for task_id, transition, state, owner, attempts in taken_back:
        task_transition(
            transition,
            task_id,
            state,
            reply_id=reply_id_for(task_id),
            owner=owner,
            attempt=attempts,
            detail=_CLOCK_DETAIL[transition],
        )


_CLOCK_DETAIL = {
    "expired": "deadline reached",
    "lease_expired": "the holder's lease ran out",
    "failed": "the holder's lease ran out on the last attempt",
    "unknown": "the holder's lease or deadline ran out after its effect started",
    "cancelled": "cancel requested; the handler did not end within the grace",
}


def settled(
    claims: Sequence[Claim], results: Sequence[object], durations: dict[str, float]
) -> None:
    """What a worker's commit did with each outcome (``TaskStore.settle_batch`` results:
    a reply id for ``done``, ``retry`` or ``failed``, or the refusal); ``durations``: the
    handler call time by task id."""
    routine = enabled("done")
    if not routine and not enabled():
        return
    for claim, result in zip(claims, results, strict=True):
        if not routine and isinstance(result, str) and result not in ("retry", "failed"):
            continue  # done, not logged at this level: the common case costs one look
        took = durations.get(claim.task_id)
        if isinstance(result, TaskCancelled):
            continue  # the worker logs it with its other cancellations
        if isinstance(result, StaleError):
            claim_transition("stale", claim, None, duration_s=took, detail=str(result))
        elif result in ("retry", "failed"):
            state = "pending" if result == "retry" else "failed"
            claim_transition(str(result), claim, state, duration_s=took)
        else:
            claim_transition("done", claim, "done", duration_s=took)


def reply_fields(row: Any, transition: str = "reply_dead") -> dict[str, Any]:
    """The ids of an outbox row (``outbox_types.OutboxRow``), for a delivery line's
    ``extra``: the reply's own transition (``reply_dead``), its task and request."""
    fields = {
        "transition": transition,
        "reply_id": row.reply_id,
        "task_id": row.task_id,
        "message_id": row.message_id,
        "principal": row.principal,
        "state": "dead" if transition == "reply_dead" else None,
        "attempt": row.attempts,
        "fence": row.fence,
    }
    return {k: v for k, v in fields.items() if v is not None}
