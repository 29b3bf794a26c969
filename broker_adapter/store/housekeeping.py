"""Housekeeping of the task table: the clock applied to deadlines and leases.

``reconcile_in`` runs first in every claim transaction (and on its own, ``reconcile``):
live tasks past their deadline end ``expired``; running tasks whose lease ran out go back
to ``pending``, or end ``failed`` when that was their last attempt (attempts are counted
at claim, so a handler that kills its worker still spends its budget). Each terminal
state comes with its reply (``lifecycle.to_terminal``). Forgetting old requests is
``retention``'s (``TaskStore.purge_batch``).
"""

from __future__ import annotations

import sqlite3

from broker_adapter.store.lifecycle import TaskState, to_terminal
from broker_adapter.store.transitions import Reconciled


def reconcile_in(
    c: sqlite3.Connection, now: float, taken: list[Reconciled] | None = None
) -> dict[str, int]:
    """Apply ``now`` inside the caller's transaction; each task it moved is appended to
    ``taken`` (``transitions.reconciled`` logs them once the transaction committed).

    Returns:
        counts by what happened: ``expired``, ``requeued``, ``exhausted``.
    """
    counts = {"expired": 0, "requeued": 0, "exhausted": 0}
    for (task_id,) in c.execute(
        "SELECT task_id FROM tasks INDEXED BY tasks_live_deadline"
        " WHERE state IN ('pending', 'running') AND deadline <= ?",
        (now,),
    ).fetchall():
        to_terminal(c, task_id, TaskState.EXPIRED, now, error="deadline reached")
        counts["expired"] += 1
        if taken is not None:
            taken.append((task_id, "expired", "expired", None, None))
    for r in c.execute(
        "SELECT task_id, attempts, max_attempts, owner FROM tasks INDEXED BY tasks_leases"
        " WHERE state = 'running' AND lease_until <= ?",
        (now,),
    ).fetchall():
        if r["attempts"] >= r["max_attempts"]:
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
