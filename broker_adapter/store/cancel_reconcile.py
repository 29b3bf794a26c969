"""The end of a cancelled task whose effect had started (``docs/RULES.md`` rule 11: a cancel
cannot undo an effect that already happened).

A cancel requested while the effect ran, or of a task already ``unknown``
(``EffectsStore.request_cancel``), leaves the task ``unknown`` with its
``cancel_requested_at``: only the reconcile can tell whether the effect happened. When it
can (``done`` or ``not-done``), ``resolve_cancelled`` ends the task ``cancelled``, never
``done`` nor back to ``pending``: what was asked to stop does not run again. Its reply
carries the reconcile's answer and the compensations (the stage undoes a happened effect
first, under its one ``cancelled`` record: ``EffectsStore.begin_compensation``), and the
reconcile record is written in the same transaction, as every reconcile outcome is.
"""

from __future__ import annotations

from typing import Any, Literal

from broker_adapter.store.effects import EffectsStore
from broker_adapter.store.lifecycle import to_terminal
from broker_adapter.store.reconcile_log import log_reconcile, reply_member, unknown_holder
from broker_adapter.store.task_types import TaskState


def resolve_cancelled(
    effects: EffectsStore,
    task_id: str,
    owner: str,
    fence: int,
    outcome: Literal["done", "not-done", "unknown"],
    observed: Any = None,
    *,
    note: str | None = None,
) -> str:
    """End the cancel-requested ``unknown`` task the caller holds for its reconcile as
    ``cancelled``, the reconcile having found the effect ``done`` (it happened) or
    ``not-done``.

    Returns:
        the reply id.

    Raises:
        StaleError: the caller does not hold the reconcile; nothing was written.
        ValueError: ``outcome`` is ``unknown`` (the task stays for the next reconcile).
    """
    if outcome not in ("done", "not-done"):
        raise ValueError(f"a cancelled task ends on done or not-done, not {outcome!r}")
    now = effects.clock.now()
    with effects.db.write("reconcile_cancelled") as c:
        unknown_holder(c, task_id, owner, fence, now)
        log_reconcile(c, task_id, outcome, owner, fence, observed, note, now)
        member = reply_member(c, task_id, outcome, owner, note)
        undone = [x for x in member.get("compensations", []) if x["kind"] == "cancelled"]
        if outcome == "not-done":
            error = "cancel requested; the reconcile found its effect did not happen"
        elif undone and undone[0]["outcome"] == "done":
            error = "cancel requested after its effect happened; the effect was undone"
        else:
            error = "cancel requested after its effect happened; the effect stays (not undone)"
        return to_terminal(c, task_id, TaskState.CANCELLED, now, error=error, effects=member)
