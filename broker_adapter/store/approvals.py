"""Approvals: an action that ``requires_approval`` runs only while a separate record allows
that action, on that target, in that scope, until an expiry (schema migration 7).

::

    running ──no valid approval──> waiting_approval ──approval──> pending
                                                   ──approval timeout──> failed

Records are written only through ``grant_approval``, by an approver the caller has
authenticated (the CLI, an API): nothing in a task's payload can make or stand for one (a
``"human_approved": true`` in a body means nothing). The holder of a task asks
``valid_approval`` right before the effect, so a record revoked or expired since stops it;
without one it parks the task (``wait_for_approval``), and ``release_waits`` sends it back
to ``pending`` once a record exists, or ends it when its wait is over. Each method is one
short transaction with no handler, network or Redis call in it (``docs/RULES.md`` rule 9).
Both stores keep them (``store.sql``); ``release_waits`` locks the waits it acts on and skips
those another process is releasing (``dialect.skip_locked``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from broker_adapter.errors import StaleError
from broker_adapter.store.dbclock import read_now, tx_now
from broker_adapter.store.effects import EffectTasks
from broker_adapter.store.lifecycle import TaskState, to_terminal
from broker_adapter.store.sql import Conn


@dataclass(frozen=True)
class Approval:
    """One approval record: ``approver`` allowed ``action`` on ``target`` within ``scope``
    from ``granted_at`` until ``expires_at``, unless revoked."""

    approval_id: str
    action: str
    target: str
    scope: str
    approver: str
    granted_at: float
    expires_at: float
    revoked_at: float | None
    revoked_by: str | None


class ApprovalStore:
    """The approval records and waits on the database of ``tasks``.

    Args:
        tasks: the task store, either backend's (its database and clock).
    """

    def __init__(self, tasks: EffectTasks) -> None:
        self.tasks = tasks
        self.db = tasks.db
        self.clock = tasks.clock

    def grant_approval(
        self, action: str, target: str, scope: str, approver: str, expires_at: float
    ) -> str:
        """Record an approval of ``action`` on ``target`` within ``scope`` until
        ``expires_at``. ``approver`` must come from an authenticated check of the caller.

        Returns:
            the approval's id.

        Raises:
            ValueError: an empty field, or ``expires_at`` not after now.
        """
        if not (action and target and scope and approver):
            raise ValueError("an approval needs an action, a target, a scope and an approver")
        now = self.clock.now()
        if expires_at <= now:
            raise ValueError(f"expires_at {expires_at!r} is not after now ({now!r})")
        approval_id = f"a-{os.urandom(16).hex()}"
        with self.db.write("approval_grant") as c:
            c.execute(
                "INSERT INTO approvals (approval_id, action, target, scope, approver,"
                " granted_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (approval_id, action, target, scope, approver, now, expires_at),
            )
        return approval_id

    def revoke_approval(self, approval_id: str, by: str) -> bool:
        """Revoke an approval. Returns False if there is none by that id or it was
        revoked already."""
        with self.db.write("approval_revoke") as c:
            now = tx_now(c, self.clock)
            return bool(
                c.execute(
                    "UPDATE approvals SET revoked_at = ?, revoked_by = ?"
                    " WHERE approval_id = ? AND revoked_at IS NULL",
                    (now, by, approval_id),
                ).rowcount
            )

    def valid_approval(
        self, action: str, target: str, scope: str, now: float | None = None
    ) -> Approval | None:
        """An approval of exactly this action, target and scope, granted by ``now``, not
        expired and not revoked (the one that lasts longest), or ``None``. Ask it again
        right before the effect: one revoked or expired meanwhile stops it."""
        at = read_now(self.db, self.clock) if now is None else now
        row = self.db.fetch_one(
            "SELECT * FROM approvals WHERE action = ? AND target = ? AND scope = ?"
            " AND expires_at > ? AND granted_at <= ? AND revoked_at IS NULL"
            " ORDER BY expires_at DESC LIMIT 1",
            (action, target, scope, at, at),
        )
        return None if row is None else Approval(**dict(row))

    def wait_for_approval(
        self, task_id: str, owner: str, fence: int, action: str, target: str, scope: str,
        timeout_s: float,
    ) -> float:  # fmt: skip
        """The holder found no valid approval: the task waits for one (``waiting_approval``)
        until the approval timeout (never past its deadline). The attempt is given back:
        the handler did not run.

        Returns:
            when the wait ends without an approval.

        Raises:
            StaleError: the caller does not hold the task; nothing was written.
        """
        with self.db.write("approval_wait") as c:
            now = tx_now(c, self.clock)
            row = c.execute(
                "UPDATE tasks SET state = 'waiting_approval', owner = NULL, lease_until = NULL,"
                " attempts = attempts - 1, updated_at = ? WHERE task_id = ? AND state = 'running'"
                " AND owner = ? AND fence = ? AND lease_until > ? RETURNING deadline",
                (now, task_id, owner, fence, now),
            ).fetchone()
            if row is None:
                raise self.tasks.refusal(task_id, owner, fence) or StaleError(
                    task_id, "lease_expired"
                )
            until = min(now + timeout_s, float(row["deadline"]))
            c.execute(
                "INSERT INTO approval_waits (task_id, action, target, scope, since, until)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (task_id) DO UPDATE SET"
                " action = excluded.action, target = excluded.target, scope = excluded.scope,"
                " since = excluded.since, until = excluded.until",
                (task_id, action, target, scope, now, until),
            )
        return until

    def release_waits(self) -> dict[str, int]:
        """Apply approvals and the clock to the waiting tasks, in one transaction: a task
        with a valid approval goes back to ``pending`` (due now), one past its wait ends
        ``failed`` with its reply; a wait whose task is no longer waiting (cancelled) goes.

        Returns:
            counts: ``released``, ``timed_out``, ``dropped``.
        """
        counts = {"released": 0, "timed_out": 0, "dropped": 0}
        with self.db.write("approval_release") as c:
            now = tx_now(c, self.clock)
            rows = c.execute(
                "SELECT w.task_id, w.action, w.target, w.scope, w.until, t.state,"
                " EXISTS (SELECT 1 FROM approvals a WHERE a.action = w.action"
                " AND a.target = w.target AND a.scope = w.scope AND a.expires_at > ?"
                " AND a.granted_at <= ? AND a.revoked_at IS NULL) AS approved"
                " FROM approval_waits w JOIN tasks t ON t.task_id = w.task_id"
                f"{c.dialect.skip_locked}",
                (now, now),
            ).fetchall()
            for r in rows:
                task_id = r["task_id"]
                if r["state"] != TaskState.WAITING_APPROVAL:
                    counts["dropped"] += 1
                elif r["approved"]:
                    c.execute(
                        "UPDATE tasks SET state = 'pending', not_before = ?, updated_at = ?"
                        " WHERE task_id = ?",
                        (now, now, task_id),
                    )
                    counts["released"] += 1
                elif r["until"] <= now:
                    error = (
                        f"approval_timeout: no valid approval of {r['action']!r} on"
                        f" {r['target']!r} in scope {r['scope']!r}"
                    )
                    to_terminal(c, task_id, TaskState.FAILED, now, error=error)
                    counts["timed_out"] += 1
                else:
                    continue
                c.execute("DELETE FROM approval_waits WHERE task_id = ?", (task_id,))
        return counts

    def counts(self) -> dict[str, int]:
        """For ``status`` and metrics: ``approval_counts``."""
        with self.db.read() as c:
            return approval_counts(c, tx_now(c, self.clock))


def approval_counts(c: Conn, now: float) -> dict[str, int]:
    """``waiting_approval`` (tasks waiting) and approvals ``approvals_valid``,
    ``approvals_expired``, ``approvals_revoked``, read in the caller's read transaction."""
    waiting = c.execute("SELECT count(*) AS n FROM approval_waits").fetchone()["n"]
    row = c.execute(
        "SELECT count(*) FILTER (WHERE revoked_at IS NULL AND expires_at > ?) AS valid,"
        " count(*) FILTER (WHERE revoked_at IS NULL AND expires_at <= ?) AS expired,"
        " count(revoked_at) AS revoked FROM approvals",
        (now, now),
    ).fetchone()
    return {"waiting_approval": waiting, "approvals_valid": row["valid"],
            "approvals_expired": row["expired"], "approvals_revoked": row["revoked"]}  # fmt: skip
