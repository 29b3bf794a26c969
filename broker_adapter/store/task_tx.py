"""What every transaction on the task table shares, as one small object: the claim, the
holder check (``docs/RULES.md`` rule 10) and the take-back of the clock with its log.

``TaskTx`` holds the database, the clock, the policy and the randomness of one task store
(``tasks.TaskStore`` makes one and hands it to the modules that write tasks in a
transaction of their own: intake, ``inbox.accept_and_claim``; settlement,
``settle.settle``; the effect and approval records, ``effects.EffectsStore`` and
``approvals.ApprovalStore``). Its ``*_in`` methods run inside the caller's transaction;
what a take-back moved is logged by ``log_reconciled`` once that transaction committed
(``transitions.reconciled``), never from inside it. Beside them, the two answers the
effect and approval records need of the task table: ``refusal`` (the holder check as one
read, for a write that found its task gone) and ``cancel`` (a live task ended at once, in a
transaction of its own).

A claim (rule 9: owner, lease, attempts + 1, fence + 1, one short transaction) is
``fencing.claim_rows``, as for reply rows and ``unknown`` tasks.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from broker_adapter.clock import Clock
from broker_adapter.errors import StaleError, TaskCancelled
from broker_adapter.protocol.reply import reply_id_for
from broker_adapter.store import transitions
from broker_adapter.store.counters import TASK_ATTEMPTS, count_in
from broker_adapter.store.dbclock import read_now, tx_now
from broker_adapter.store.fencing import TASK_HELD_STATE, claim_rows, fence_refusal
from broker_adapter.store.housekeeping import reconcile_in
from broker_adapter.store.lifecycle import to_terminal
from broker_adapter.store.sql import Conn
from broker_adapter.store.task_types import (
    CLAIM_COLUMNS,
    TERMINAL_STATES,
    ClaimedTask,
    Reconciled,
    TaskPolicy,
    TaskState,
    UnknownTask,
    claimed_task,
)

if TYPE_CHECKING:
    from broker_adapter.store.db import Database
    from broker_adapter.store.postgres.db import PgDatabase

#: The row the holder check reads: the rule's columns and what a write after it needs
#: (``lifecycle.write_reply``'s, a failure's attempts, a renew's cancel request).
_HOLDER_COLUMNS = (
    "state, owner, fence, lease_until, deadline, attempts, max_attempts,"
    " principal, message_id, correlation_id, traceparent, cancel_requested_at"
)


class TaskTx:
    """The claim, the holder check and the take-back of one task store, for the caller's
    transaction.

    Args:
        db: the database (one per process).
        clock: time source (a ``FakeClock`` in tests).
        policy: leases, backoff (``settle``), and what intake checks.
        rng: randomness for backoff jitter.
    """

    def __init__(
        self, db: Database | PgDatabase, clock: Clock, policy: TaskPolicy, rng: random.Random
    ) -> None:
        self.db: Database | PgDatabase = db
        self.clock = clock
        self.policy = policy
        self.rng = rng
        #: Expired leases taken back (requeued or failed on the last attempt), counted in
        #: the reconciling transaction (one that then fails counts them again when it is
        #: retried): the ``ba_lease_takeovers_total`` metric.
        self.lease_takeovers = 0
        #: what the last take-back moved, logged after its transaction (``log_reconciled``)
        self.reconciled: list[Reconciled] = []

    def claim_in(self, c: Conn, owner: str, n: int, now: float) -> list[Any]:
        """A claim of up to ``n`` ready tasks for ``owner`` inside the caller's transaction,
        after the take-back (``reconcile_in``); the rows in claim order (``claimed`` makes
        them claims once the transaction committed).

        The oldest ready tasks first, taken by ``fencing.claim_rows``."""
        self.reconcile_in(c, now)
        d = c.dialect
        # ``+state`` keeps SQLite's planner on the primary key whatever index on ``state`` a
        # database may carry.
        rows = claim_rows(
            c,
            f"SELECT task_id FROM tasks{d.indexed_by('tasks_ready')}"
            " WHERE state = 'pending' AND not_before <= ? ORDER BY not_before LIMIT ?"
            + d.skip_locked,
            (now, n),
            "UPDATE tasks SET state = 'running', owner = ?, lease_until = ?,"
            " attempts = attempts + 1, fence = fence + 1, updated_at = ?"
            f" WHERE task_id IN ({{ids}}) AND {d.unindexed('state')} = 'pending'"
            f" RETURNING {CLAIM_COLUMNS}",
            (owner, now + self.policy.lease_s, now),
            "task_id",
        )
        count_in(c, TASK_ATTEMPTS, len(rows))  # with the claim: a killed worker's counts
        return rows

    def claimed(self, rows: list[Any], owner: str, now: float) -> list[ClaimedTask]:
        """The claims of ``claim_in``'s rows, made at ``now`` (built after COMMIT: decoding
        payloads need not hold the write lock)."""
        lease_until = now + self.policy.lease_s
        return [claimed_task(r, owner, lease_until) for r in rows]

    def holder(self, c: Conn, task_id: str, owner: str, fence: int) -> Any:
        """Check rule 10 (``fencing.fence_refusal``, the deadline included); raise the refusal
        (``StaleError``, and the caller's transaction rolls back) if any part fails.
        Returns the row (``_HOLDER_COLUMNS``), locked for the rest of the transaction where
        writers run at once (``for_update``): what was checked cannot change before the
        caller writes.

        Raises:
            UnknownTask: no such task.
        """
        row = c.execute(
            f"SELECT {_HOLDER_COLUMNS} FROM tasks WHERE task_id = ?" + c.dialect.for_update,
            (task_id,),
        ).fetchone()
        if row is None:
            raise UnknownTask(task_id)
        refused = fence_refusal(
            row,
            task_id,
            owner,
            fence,
            tx_now(c, self.clock),
            state=TASK_HELD_STATE,
            deadline=True,
        )
        if refused is not None:
            raise refused
        return row

    def reconcile_in(self, c: Conn, now: float) -> dict[str, int]:
        """The clock applied inside the caller's transaction (``housekeeping.reconcile_in``);
        what it moved waits for ``log_reconciled``. Returns the counts."""
        taken: list[Reconciled] = []
        self.reconciled = taken
        counts = reconcile_in(c, now, taken)
        self.lease_takeovers += counts["requeued"] + counts["exhausted"]
        return counts

    def log_reconciled(self) -> None:
        """Log what the last take-back moved (after its transaction committed)."""
        taken, self.reconciled = self.reconciled, []
        transitions.reconciled(taken)

    def refusal(self, task_id: str, owner: str, fence: int) -> StaleError | None:
        """Whether ``owner`` still holds ``task_id`` under ``fence``: rule 10's check as one
        read statement (no transaction), the deadline left to the caller. Returns the
        refusal (``TaskCancelled``, ``FencedError``, or a ``StaleError`` saying why the
        claim is gone), or None while it holds. A worker asks it before a handler starts
        and whenever the handler asks ``Task.cancelled()``. A running task whose cancel was
        requested is refused as ``TaskCancelled`` here (its handler is to stop), while its
        renewals still hold during the grace."""
        row = self.db.fetch_one(
            "SELECT state, owner, fence, lease_until, deadline, cancel_requested_at FROM tasks"
            " WHERE task_id = ?",
            (task_id,),
        )
        if row is None:
            return StaleError(task_id, "not_running", "no such task")
        refused = fence_refusal(
            row,
            task_id,
            owner,
            fence,
            read_now(self.db, self.clock),
            state=TASK_HELD_STATE,
            deadline=False,
        )
        if refused is None and row["cancel_requested_at"] is not None:
            return TaskCancelled(task_id)  # requested (``EffectsStore.request_cancel``)
        return refused

    def cancel(self, task_id: str, reason: str = "cancelled") -> TaskState:
        """Cancel a live task durably (with its reply), in a transaction of its own. A
        running handler is fenced out: its renew and commit are refused from now on. An
        effect it already caused stays.

        Returns:
            the task's state afterwards (unchanged if it was already terminal).

        Raises:
            UnknownTask: no such task.
        """
        with self.db.write("cancel") as c:
            now = tx_now(c, self.clock)
            row = c.execute(
                "SELECT state FROM tasks WHERE task_id = ?" + c.dialect.for_update, (task_id,)
            ).fetchone()
            if row is None:
                raise UnknownTask(task_id)
            state = TaskState(row["state"])
            if state in TERMINAL_STATES:
                return state
            to_terminal(c, task_id, TaskState.CANCELLED, now, error=reason)
        transitions.task_transition(
            "cancelled", task_id, "cancelled", detail=reason, reply_id=reply_id_for(task_id)
        )
        return TaskState.CANCELLED
