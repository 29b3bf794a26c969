"""Housekeeping of the task table: the clock applied to deadlines and leases.

``reconcile_in`` runs first in every claim transaction (and on its own, ``reconcile``):
first, a running task whose current attempt marked its effect started
(``effects.EffectsStore.mark_effect_started``) and whose lease ran out or deadline passed
goes to ``unknown`` (``unknown_from_lapsed_in``: a retry could repeat the effect, the
reconcile decides); then live tasks past their deadline end ``expired``; running tasks
whose lease ran out go back to ``pending``, or end ``failed`` when that was their last
attempt (attempts are counted at claim, so a handler that kills its worker still spends its
budget). Each terminal state comes with its reply (``lifecycle.to_terminal``). Forgetting
old requests is ``retention``'s (``TaskStore.purge_batch``).

Both stores run it (``store.sql``). On PostgreSQL several processes take back at once: each
selection skips the rows another transaction holds locked (``dialect.skip_locked``: that one
is settling or taking them back already, and the next claim sees them again); SQLite has one
writer at a time, and keeps its index hints (``Dialect.indexed_by``) on its hot path."""

from __future__ import annotations

import functools

from broker_adapter.store.counters import TASK_UNKNOWN, count_in
from broker_adapter.store.lifecycle import to_terminal
from broker_adapter.store.sql import Conn, Dialect
from broker_adapter.store.task_types import CLOCKED_SQL, Reconciled, TaskState


def reconcile_in(c: Conn, now: float, taken: list[Reconciled] | None = None) -> dict[str, int]:
    """Apply ``now`` inside the caller's transaction; each task it moved is appended to
    ``taken`` (``transitions.reconciled`` logs them once the transaction committed).

    Returns:
        counts by what happened: ``expired``, ``requeued``, ``exhausted`` (and ``unknown``
        when an effect-started task lapsed: only then, so the common answer stays small).
    """
    counts = {"expired": 0, "requeued": 0, "exhausted": 0}
    unknown = unknown_from_lapsed_in(c, now, taken)
    if unknown:
        counts["unknown"] = unknown
    expired_sql, lapsed_sql, _ = _statements(c.dialect)
    for d in c.execute(expired_sql, (now,)).fetchall():
        task_id = d["task_id"]
        to_terminal(c, task_id, TaskState.EXPIRED, now, error="deadline reached")
        counts["expired"] += 1
        if taken is not None:
            taken.append((task_id, "expired", "expired", None, None))
    for r in c.execute(lapsed_sql, (now,)).fetchall():
        if r["cancel_requested_at"] is not None:
            error = (
                f"cancel requested; the handler of {r['owner']} did not end within the"
                " grace: what it did is not known"
            )
            to_terminal(c, r["task_id"], TaskState.CANCELLED, now, error=error)
            counts["cancelled"] = counts.get("cancelled", 0) + 1
            if taken is not None:
                taken.append((r["task_id"], "cancelled", "cancelled", r["owner"], r["attempts"]))
        elif r["attempts"] >= r["max_attempts"]:
            to_terminal(
                c,
                r["task_id"],
                TaskState.FAILED,
                now,
                error=f"lease of {r['owner']} expired on the last attempt "
                f"({r['attempts']}/{r['max_attempts']})",
            )
            counts["exhausted"] += 1
            if taken is not None:
                taken.append((r["task_id"], "failed", "failed", r["owner"], r["attempts"]))
        else:
            c.execute(
                "UPDATE tasks SET state = 'pending', owner = NULL, lease_until = NULL,"
                " not_before = ?, error = ?, updated_at = ? WHERE task_id = ?",
                (now, f"lease of {r['owner']} expired", now, r["task_id"]),
            )
            counts["requeued"] += 1
            if taken is not None:
                taken.append((r["task_id"], "lease_expired", "pending", r["owner"], r["attempts"]))
    return counts


_TO_UNKNOWN = (
    "UPDATE tasks SET state = 'unknown', not_before = ?, updated_at = ?,"
    " error = 'the claim of ' || coalesce(owner, ?) || ' lapsed after its effect"
    " started', owner = NULL, lease_until = NULL, reconcile_tries = 0,"
    " operator_since = NULL WHERE task_id IN ({select})"
    " RETURNING task_id, attempts"
)
#: Both selections go through a partial index on running tasks (no scan on the hot path):
#: the lease ran out, or the deadline passed, on an attempt that marked its effect started.
_LAPSED_LEASE = (
    "SELECT task_id FROM tasks{hint} WHERE state = 'running'"
    " AND lease_until <= ? AND effect_fence = fence{lock}"
)
_LAPSED_DEADLINE = (
    "SELECT task_id FROM tasks{hint}"
    f" WHERE state IN {CLOCKED_SQL} AND deadline <= ? AND state = 'running'"
    " AND effect_fence = fence{lock}"
)


@functools.cache
def _statements(dialect: Dialect) -> tuple[str, str, tuple[str, str]]:
    """The take-back's statements in ``dialect`` (made once): the live tasks past their
    deadline, the running ones whose lease ran out, and ``unknown_from_lapsed_in``'s two."""
    hint = dialect.indexed_by
    lock = dialect.skip_locked
    expired = (
        f"SELECT task_id FROM tasks{hint('tasks_live_deadline')}"
        f" WHERE state IN {CLOCKED_SQL} AND deadline <= ?{lock}"
    )
    lapsed = (
        "SELECT task_id, attempts, max_attempts, owner, cancel_requested_at FROM tasks"
        f"{hint('tasks_leases')} WHERE state = 'running' AND lease_until <= ?{lock}"
    )
    to_unknown = tuple(
        _TO_UNKNOWN.format(select=select.format(hint=hint(index), lock=lock))
        for select, index in (
            (_LAPSED_LEASE, "tasks_leases"),
            (_LAPSED_DEADLINE, "tasks_live_deadline"),
        )
    )
    return expired, lapsed, (to_unknown[0], to_unknown[1])


def unknown_from_lapsed_in(c: Conn, now: float, taken: list[Reconciled] | None = None) -> int:
    """Inside the caller's transaction, before the other take-backs: every running task
    whose current attempt marked its effect started and whose lease ran out or deadline
    passed goes to ``unknown``, never back to ``pending`` nor to ``expired`` (its deadline
    bounds new attempts, not finding out what one did). Returns how many."""
    n = 0
    for statement in _statements(c.dialect)[2]:
        rows = c.execute(statement, (now, now, "?", now)).fetchall()
        n += len(rows)
        if taken is not None:
            taken.extend((r["task_id"], "unknown", "unknown", None, r["attempts"]) for r in rows)
    count_in(c, TASK_UNKNOWN, n)  # the take-back's transitions, committed with them
    return n
