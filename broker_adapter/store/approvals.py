"""Approvals: an action that ``requires_approval`` runs only while a separate record allows
that action, on that target, in that scope, for that requesting principal and those
arguments (``arguments_digest``: the digest of the effect's canonical arguments and key
version, ``handler.effects.arguments_digest``), until an expiry, for a number of tasks
(``uses``, default one) (schema migrations 7 and 10).

::

    running ──no valid approval──> waiting_approval ──approval──> pending
                                                   ──approval timeout──> failed

Records are written only through ``grant_approval``, by an approver the caller has
authenticated (the CLI, an API): nothing in a task's payload can make or stand for one (a
``"human_approved": true`` in a body means nothing). The holder of a task takes one use of
a matching record right before the effect (``use_approval``: a record revoked, expired or
used up since stops it; a task that used one keeps it for its retries while it is valid);
without one it parks the task (``wait_for_approval``, which keeps what is to be approved
for the approver to see), and ``release_waits`` sends it back to ``pending`` once a record
with a use left exists, or ends it when its wait is over. Each method is one
short transaction with no handler, network or Redis call in it (``docs/RULES.md`` rule 9).
Both stores keep them (``store.sql``); ``release_waits`` locks the waits it acts on and skips
those another process is releasing (``dialect.skip_locked``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from broker_adapter.errors import StaleError
from broker_adapter.store.dbclock import read_now, tx_now
from broker_adapter.store.fencing import TASK_HELD, TASK_HELD_PAST_DEADLINE, held_params
from broker_adapter.store.lifecycle import to_terminal
from broker_adapter.store.sql import Conn
from broker_adapter.store.task_tx import TaskTx
from broker_adapter.store.task_types import TaskState


@dataclass(frozen=True)
class Approval:
    """One approval record: ``approver`` allowed ``action`` on ``target`` within ``scope``,
    asked by ``principal`` with the arguments whose digest is ``arguments_digest``, from
    ``granted_at`` until ``expires_at``, for ``uses`` tasks (``used`` so far), unless
    revoked. A record made before approvals were bound (migration 10) has no principal or
    digest and allows nothing."""

    approval_id: str
    action: str
    target: str
    scope: str
    approver: str
    granted_at: float
    expires_at: float
    revoked_at: float | None
    revoked_by: str | None
    principal: str | None = None
    arguments_digest: str | None = None
    uses: int = 1
    used: int = 0


#: A record that allows a use at ``?`` (twice): unrevoked, granted, unexpired, a use left.
_USABLE = "revoked_at IS NULL AND granted_at <= ? AND expires_at > ? AND used < uses"
#: ... and matches ``action, target, scope, principal, arguments_digest`` (five ``?``).
_MATCHES = "action = ? AND target = ? AND scope = ? AND principal = ? AND arguments_digest = ?"


@dataclass(frozen=True)
class Wait:
    """A task waiting for its approval: what an approver is asked to allow."""

    task_id: str
    action: str
    target: str
    scope: str
    principal: str | None
    arguments_digest: str | None
    arguments: str | None
    since: float
    until: float


_APPROVAL_COLUMNS = ", ".join(Approval.__dataclass_fields__)


class ApprovalStore:
    """The approval records and waits on the database of a task store.

    Args:
        tx: the task store's transaction object (``TaskStore.tx``): its database, its
            clock and its holder check.
    """

    def __init__(self, tx: TaskTx) -> None:
        self.tx = tx
        self.db = tx.db
        self.clock = tx.clock

    def grant_approval(
        self,
        action: str,
        target: str,
        scope: str,
        approver: str,
        expires_at: float,
        *,
        principal: str,
        arguments_digest: str,
        uses: int = 1,
    ) -> str:
        """Record an approval of ``action`` on ``target`` within ``scope``, for tasks of
        ``principal`` whose effect's arguments have ``arguments_digest``, until
        ``expires_at``, for ``uses`` tasks. ``approver`` must come from an authenticated
        check of the caller.

        Returns:
            the approval's id.

        Raises:
            ValueError: an empty field, ``uses`` below 1, or ``expires_at`` not after now.
        """
        if not (action and target and scope and approver and principal and arguments_digest):
            raise ValueError(
                "an approval needs an action, a target, a scope, an approver, the requesting"
                " principal and the arguments' digest"
            )
        if isinstance(uses, bool) or not isinstance(uses, int) or uses < 1:
            raise ValueError(f"uses must be an integer >= 1, got {uses!r}")
        approval_id = f"a-{os.urandom(16).hex()}"
        with self.db.write("approval_grant") as c:
            now = tx_now(c, self.clock)
            if expires_at <= now:
                raise ValueError(f"expires_at {expires_at!r} is not after now ({now!r})")
            c.execute(
                "INSERT INTO approvals (approval_id, action, target, scope, approver,"
                " granted_at, expires_at, principal, arguments_digest, uses)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    approval_id,
                    action,
                    target,
                    scope,
                    approver,
                    now,
                    expires_at,
                    principal,
                    arguments_digest,
                    uses,
                ),
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
        self,
        action: str,
        target: str,
        scope: str,
        now: float | None = None,
        *,
        principal: str,
        arguments_digest: str,
    ) -> Approval | None:
        """An approval of exactly this action, target, scope, principal and arguments'
        digest, granted by ``now``, not expired, not revoked and with a use left (the one
        that lasts longest), or ``None``. A read: ``use_approval`` takes the use."""
        at = read_now(self.db, self.clock) if now is None else now
        row = self.db.fetch_one(
            f"SELECT {_APPROVAL_COLUMNS} FROM approvals WHERE {_MATCHES} AND {_USABLE}"
            " ORDER BY expires_at DESC LIMIT 1",
            (action, target, scope, principal, arguments_digest, at, at),
        )
        return None if row is None else Approval(**dict(row))

    def use_approval(
        self,
        task_id: str,
        owner: str,
        fence: int,
        action: str,
        target: str,
        scope: str,
        *,
        principal: str,
        arguments_digest: str,
    ) -> Approval | None:
        """Right before the effect, the holder of ``task_id`` takes one use of a matching
        approval (``valid_approval``'s rule) and records it on the task, in one
        transaction; a task that took one already (a retry) keeps it while it is neither
        revoked nor expired, using nothing more. Returns the approval, or ``None`` (no
        record allows it now: park the task).

        Raises:
            StaleError: the caller does not hold the task; nothing was written.
        """
        with self.db.write("approval_use") as c:
            now = tx_now(c, self.clock)
            held = c.execute(
                f"SELECT approval_id FROM tasks WHERE task_id = ? AND {TASK_HELD}"
                + c.dialect.for_update,
                (task_id, *held_params(fence, owner, now, deadline=True)),
            ).fetchone()
            if held is None:
                raise self.tx.refusal(task_id, owner, fence) or StaleError(task_id, "lease_expired")
            if held["approval_id"] is not None:
                row = c.execute(
                    f"SELECT {_APPROVAL_COLUMNS} FROM approvals WHERE approval_id = ?"
                    f" AND {_MATCHES} AND revoked_at IS NULL AND expires_at > ?",
                    (held["approval_id"], action, target, scope, principal, arguments_digest, now),
                ).fetchone()
                if row is not None:
                    return Approval(**dict(row))
            row = c.execute(
                f"UPDATE approvals SET used = used + 1 WHERE approval_id = (SELECT approval_id"
                f" FROM approvals WHERE {_MATCHES} AND {_USABLE} ORDER BY expires_at DESC"
                f" LIMIT 1{c.dialect.for_update}) AND used < uses RETURNING {_APPROVAL_COLUMNS}",
                (action, target, scope, principal, arguments_digest, now, now),
            ).fetchone()
            if row is None:
                return None
            c.execute(
                "UPDATE tasks SET approval_id = ? WHERE task_id = ?", (row["approval_id"], task_id)
            )
            return Approval(**dict(row))

    def wait_for_approval(
        self,
        task_id: str,
        owner: str,
        fence: int,
        action: str,
        target: str,
        scope: str,
        timeout_s: float,
        *,
        principal: str,
        arguments_digest: str,
        arguments: str | None = None,
    ) -> float:
        """The holder found no valid approval: the task waits for one (``waiting_approval``)
        until the approval timeout (never past its deadline), keeping what is to be
        approved (the principal, the arguments' digest and, for the approver to read, the
        arguments as canonical JSON). The attempt is given back: the handler did not run.

        Returns:
            when the wait ends without an approval.

        Raises:
            StaleError: the caller does not hold the task; nothing was written.
        """
        with self.db.write("approval_wait") as c:
            now = tx_now(c, self.clock)
            row = c.execute(
                "UPDATE tasks SET state = 'waiting_approval', owner = NULL, lease_until = NULL,"
                " attempts = attempts - 1, updated_at = ? WHERE task_id = ?"
                f" AND {TASK_HELD_PAST_DEADLINE} RETURNING deadline",
                (now, task_id, *held_params(fence, owner, now, deadline=False)),
            ).fetchone()
            if row is None:
                raise self.tx.refusal(task_id, owner, fence) or StaleError(task_id, "lease_expired")
            until = min(now + timeout_s, float(row["deadline"]))
            c.execute(
                "INSERT INTO approval_waits (task_id, action, target, scope, since, until,"
                " principal, arguments_digest, arguments) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (task_id) DO UPDATE SET action = excluded.action,"
                " target = excluded.target, scope = excluded.scope, since = excluded.since,"
                " until = excluded.until, principal = excluded.principal,"
                " arguments_digest = excluded.arguments_digest,"
                " arguments = excluded.arguments",
                (
                    task_id,
                    action,
                    target,
                    scope,
                    now,
                    until,
                    principal,
                    arguments_digest,
                    c.dialect.text(arguments),
                ),
            )
        return until

    def waits(self, task_id: str | None = None) -> list[Wait]:
        """The tasks waiting for an approval (or ``task_id``'s wait), oldest first."""
        where, params = ("WHERE task_id = ?", (task_id,)) if task_id is not None else ("", ())
        with self.db.read() as c:
            rows = c.execute(
                "SELECT task_id, action, target, scope, principal, arguments_digest, arguments,"
                f" since, until FROM approval_waits {where} ORDER BY since",
                params,
            ).fetchall()
        return [Wait(**dict(r)) for r in rows]

    def release_waits(self) -> dict[str, int]:
        """Apply approvals and the clock to the waiting tasks, in one transaction: a task
        with a valid approval goes back to ``pending`` (due now) and the approval that
        released it is kept (``approval_releases``, for the audit), one past its wait ends
        ``failed`` with its reply; a wait whose task is no longer waiting (cancelled) goes.

        Returns:
            counts: ``released``, ``timed_out``, ``dropped``.
        """
        counts = {"released": 0, "timed_out": 0, "dropped": 0}
        with self.db.write("approval_release") as c:
            now = tx_now(c, self.clock)
            rows = c.execute(
                "SELECT w.task_id, w.action, w.target, w.scope, w.until, t.state,"
                " (SELECT a.approval_id FROM approvals a WHERE a.action = w.action"
                " AND a.target = w.target AND a.scope = w.scope AND a.principal = w.principal"
                " AND a.arguments_digest = w.arguments_digest AND a.expires_at > ?"
                " AND a.granted_at <= ? AND a.revoked_at IS NULL AND a.used < a.uses"
                " ORDER BY a.expires_at DESC LIMIT 1) AS approved"
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
                    c.execute(
                        "INSERT INTO approval_releases (task_id, approval_id, released_at)"
                        " VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                        (task_id, r["approved"], now),
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
        "SELECT count(*) FILTER (WHERE revoked_at IS NULL AND expires_at > ?"
        " AND used < uses) AS valid,"
        " count(*) FILTER (WHERE revoked_at IS NULL AND (expires_at <= ? OR used >= uses))"
        " AS expired,"
        " count(revoked_at) AS revoked FROM approvals",
        (now, now),
    ).fetchone()
    return {
        "waiting_approval": waiting,
        "approvals_valid": row["valid"],
        "approvals_expired": row["expired"],
        "approvals_revoked": row["revoked"],
    }
