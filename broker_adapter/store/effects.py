"""Effects beyond our transaction: the records and state changes behind ``unknown``,
reconciliation, compensation and cancel requests (schema migration 7; approvals are
``approvals.py``).

::

    running ──timeout / lost lease after the effect started──> unknown
    unknown ──reconcile claim (lease, fence+1)──> unknown, held
            ──"it happened"──> done (the observed result, with its reply)
            ──"it did not"──> pending (retry) | failed (no attempt left) | expired (deadline)
            ──"still unknown"──> unknown (backs off; after the limit: waits for an operator)

A task's attempt marks its effect as started (``mark_effect_started``: the fence of that
attempt in ``effect_fence``) before the effect; a lease that runs out on an attempt so marked
sends the task to ``unknown`` instead of back to ``pending`` (the store's lease take-back:
``housekeeping.unknown_from_lapsed_in``). An ``unknown`` task is held under a lease and a fence like
any claim (``claim_unknown``); its deadline does not end it (it bounds new attempts, not
finding out what one did). Every reconcile outcome, automatic or an operator's, is written
to ``reconcile_log`` in the transaction that acts on it. A compensation has one record per
(task, kind): it is begun at most once, so it runs at most once; one begun and never ended
(a crash) stays ``started`` for an operator.

No handler, network or Redis call runs inside these transactions (``docs/RULES.md`` rule 9):
each method is one short transaction; the reconcile and compensation functions run between
them.

Both stores keep these records (``store.sql``: one SQL text). Where a method reads a row and
then writes it, the read takes the row's lock (``dialect.for_update``), and the reconcile
claim skips the rows another reconciler is taking (``dialect.skip_locked``), so several
processes on one PostgreSQL database never take one task twice nor act on a row that moved
under them; on SQLite, one writer at a time, both clauses are empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from broker_adapter.errors import StaleError, TaskCancelled
from broker_adapter.protocol.bounds import check_result
from broker_adapter.store.counters import (
    COMPENSATIONS,
    TASK_UNKNOWN,
    count_in,
    monotonic_counts,
)
from broker_adapter.store.dbclock import tx_now
from broker_adapter.store.evidence import ADAPTER_VERSION, EVIDENCE
from broker_adapter.store.fencing import (
    TASK_HELD_PAST_DEADLINE,
    TASK_OWNED,
    claim_rows,
    held_params,
)
from broker_adapter.store.lifecycle import to_terminal
from broker_adapter.store.reconcile_log import (
    ReconcileRecord,
    log_reconcile,
    reconcile_records,
    reply_member,
    unknown_holder,
)
from broker_adapter.store.sql import Conn
from broker_adapter.store.task_tx import TaskTx
from broker_adapter.store.task_types import (
    CLAIM_COLUMNS,
    ClaimedTask,
    TaskState,
    UnknownTask,
    claimed_task,
)

CompensationOutcome = Literal["done", "failed"]


@dataclass(frozen=True)
class ReconcileClaim:
    """An ``unknown`` task held for one reconcile: the task as a claim (its ``fence`` is
    the reconcile's) and how many reconciles found nothing before."""

    task: ClaimedTask
    tries: int


@dataclass(frozen=True)
class CompensationRecord:
    task_id: str
    kind: str
    by_whom: str
    fence: int
    what: str
    started_at: float
    outcome: str
    detail: str | None
    ended_at: float | None


class EffectsStore:
    """The effect records on the database of a task store, with its clock.

    Args:
        tx: the task store's transaction object (``TaskStore.tx``): its database, its
            clock, its holder check and its cancel.
    """

    def __init__(self, tx: TaskTx) -> None:
        self.tx = tx
        self.db = tx.db
        self.clock = tx.clock

    # -- cancel requests ------------------------------------------------------------------

    def request_cancel(self, task_id: str, reason: str = "cancelled") -> TaskState:
        """Cancel a task: a running one gets ``cancel_requested_at`` (its handler sees it
        at its next check and its outcome says what was done), and so does an ``unknown``
        one (its reconcile ends it ``cancelled``: ``cancel_reconcile``); any other live one
        is cancelled at once (``TaskTx.cancel``).

        Returns:
            ``RUNNING`` or ``UNKNOWN`` when the request was recorded (or already was),
            else the state ``TaskTx.cancel`` left.

        Raises:
            UnknownTask: no such task.
        """
        with self.db.write("cancel_request") as c:
            now = tx_now(c, self.clock)
            row = c.execute(
                f"SELECT state FROM tasks WHERE task_id = ?{c.dialect.for_update}", (task_id,)
            ).fetchone()
            if row is None:
                raise UnknownTask(task_id)
            if row["state"] in (TaskState.RUNNING, TaskState.UNKNOWN):
                c.execute(
                    "UPDATE tasks SET cancel_requested_at = coalesce(cancel_requested_at, ?),"
                    " updated_at = ? WHERE task_id = ?",
                    (now, now, task_id),
                )
                return TaskState(row["state"])
        return self.tx.cancel(task_id, reason)

    def end_requested_cancel(self, task_id: str, owner: str, fence: int, what: str) -> bool:
        """The holder of a running task whose cancel was requested stopped it: ``cancelled``
        with its reply, ``what`` saying what was known to have happened. Returns False if
        the caller no longer holds it (cancelled outright, or the claim moved on)."""
        with self.db.write("cancel_request") as c:
            now = tx_now(c, self.clock)
            row = c.execute(
                f"SELECT cancel_requested_at FROM tasks WHERE task_id = ? AND {TASK_OWNED}"
                f" AND cancel_requested_at IS NOT NULL{c.dialect.for_update}",
                (task_id, *held_params(fence, owner, now, deadline=False, lease=False)),
            ).fetchone()
            if row is None:
                return False
            since = row["cancel_requested_at"]
            error = f"cancel requested {now - since:.3f} s before the handler stopped; {what}"
            to_terminal(c, task_id, TaskState.CANCELLED, now, error=error)
        return True

    def cancel_requested(self, task_id: str) -> float | None:
        """When a cancel of the running task was requested, or ``None``."""
        row = self.db.fetch_one(
            "SELECT cancel_requested_at FROM tasks WHERE task_id = ?", (task_id,)
        )
        if row is None or row["cancel_requested_at"] is None:
            return None
        return float(row["cancel_requested_at"])

    # -- entering unknown -----------------------------------------------------------------

    def mark_effect_started(
        self, task_id: str, owner: str, fence: int, *, key_digest: str | None = None
    ) -> None:
        """Record, before the effect, that this attempt starts an effect it cannot take
        back: from now on its timeout or lost lease sends the task to ``unknown``. A cancel
        requested before is seen here: the effect must not start. The task keeps
        ``key_digest`` (``evidence.key_digest`` of the effect's key) and this adapter's
        version.

        Raises:
            TaskCancelled: a cancel was requested (or made); nothing was written.
            StaleError: the caller does not hold the task; nothing was written.
        """
        with self.db.write("effect_started") as c:
            now = tx_now(c, self.clock)
            hit = c.execute(
                "UPDATE tasks SET effect_fence = fence, effect_started_at = ?, updated_at = ?,"
                " effect_key_digest = coalesce(?, effect_key_digest), adapter_version = ?"
                f" WHERE task_id = ? AND {TASK_HELD_PAST_DEADLINE}"
                " AND cancel_requested_at IS NULL",
                (
                    now,
                    now,
                    key_digest,
                    ADAPTER_VERSION,
                    task_id,
                    *held_params(fence, owner, now, deadline=False),
                ),
            ).rowcount
        if not hit:
            refusal = self.tx.refusal(task_id, owner, fence)
            if refusal is None and self.cancel_requested(task_id) is not None:
                refusal = TaskCancelled(task_id)
            raise refusal or StaleError(task_id, "lease_expired")

    def to_unknown(self, task_id: str, owner: str, fence: int, reason: str) -> None:
        """The holder gives up a task whose effect may have happened (a timeout, an error
        that asks for a retry): ``unknown``, to be reconciled.

        Raises:
            StaleError: the caller does not hold the task; nothing was written.
        """
        with self.db.write("to_unknown") as c:
            now = tx_now(c, self.clock)
            hit = c.execute(
                "UPDATE tasks SET state = 'unknown', owner = NULL, lease_until = NULL,"
                " not_before = ?, error = ?, reconcile_tries = 0, operator_since = NULL,"
                f" updated_at = ? WHERE task_id = ? AND {TASK_HELD_PAST_DEADLINE}",
                (
                    now,
                    self.db.dialect.text(reason),
                    now,
                    task_id,
                    *held_params(fence, owner, now, deadline=False),
                ),
            ).rowcount
            count_in(c, TASK_UNKNOWN, hit)
        if not hit:
            raise self.tx.refusal(task_id, owner, fence) or StaleError(task_id, "lease_expired")

    # -- reconcile ------------------------------------------------------------------------

    def claim_unknown(self, owner: str, n: int, lease_s: float) -> list[ReconcileClaim]:
        """Hold up to ``n`` ``unknown`` tasks due for a reconcile (oldest due first; none
        waiting for an operator): owner, lease, fence + 1. The attempt count is left alone.
        While held, a task is not due (``not_before`` is its lease's end), so a reconciler
        that dies frees it when its lease runs out. The claim is ``fencing.claim_rows``."""
        if n < 1:
            return []
        with self.db.write("claim_unknown") as c:
            now = tx_now(c, self.clock)
            until = now + lease_s
            rows = claim_rows(
                c,
                f"SELECT task_id FROM tasks{c.dialect.indexed_by('tasks_unknown')}"
                " WHERE state = 'unknown' AND not_before <= ? AND operator_since IS NULL"
                f" ORDER BY not_before LIMIT ?{c.dialect.skip_locked}",
                (now, n),
                "UPDATE tasks SET owner = ?, lease_until = ?, not_before = ?, fence = fence + 1,"
                " updated_at = ? WHERE task_id IN ({ids})"
                f" RETURNING {CLAIM_COLUMNS}, reconcile_tries",
                (owner, until, until, now),
                "task_id",
            )
        return [
            ReconcileClaim(claimed_task(r, owner, until), int(r["reconcile_tries"])) for r in rows
        ]

    def resolve_done(
        self, task_id: str, owner: str, fence: int, observed: Any, *, note: str | None = None
    ) -> str:
        """The reconcile found the effect happened: ``done`` with ``observed`` as the result.

        Returns:
            the reply id.

        Raises:
            StaleError: the caller does not hold the reconcile; nothing was written.
            ValueError: ``observed`` is not a JSON value within the result bounds.
        """
        encoded = check_result(observed).decode("utf-8")
        with self.db.write("reconcile_done") as c:
            now = tx_now(c, self.clock)
            unknown_holder(c, task_id, owner, fence, now)
            return self._done_in(c, task_id, owner, fence, encoded, note, now)

    def resolve_not_done(
        self,
        task_id: str,
        owner: str,
        fence: int,
        *,
        observed: Any = None,
        note: str | None = None,
    ) -> TaskState:
        """The reconcile found the effect did not happen: the task may run again.

        Returns:
            ``PENDING`` (due now), or ``FAILED`` when no attempt is left, or ``EXPIRED``
            when its deadline has passed (both with their reply).

        Raises:
            StaleError: the caller does not hold the reconcile; nothing was written.
        """
        with self.db.write("reconcile_not_done") as c:
            now = tx_now(c, self.clock)
            row = unknown_holder(c, task_id, owner, fence, now)
            return self._not_done_in(c, row, owner, fence, observed, note, now)

    def resolve_unknown(
        self,
        task_id: str,
        owner: str,
        fence: int,
        retry_at: float | None,
        *,
        observed: Any = None,
        note: str | None = None,
    ) -> None:
        """The reconcile could not tell: the task stays ``unknown``, one try more, due again
        at ``retry_at``, or, with ``None``, waiting for an operator.

        Raises:
            StaleError: the caller does not hold the reconcile; nothing was written.
        """
        with self.db.write("reconcile_unknown") as c:
            now = tx_now(c, self.clock)
            unknown_holder(c, task_id, owner, fence, now)
            log_reconcile(c, task_id, "unknown", owner, fence, observed, note, now)
            c.execute(
                "UPDATE tasks SET owner = NULL, lease_until = NULL, not_before = ?,"
                " reconcile_tries = reconcile_tries + 1, operator_since = ?, updated_at = ?"
                " WHERE task_id = ?",
                (
                    now if retry_at is None else retry_at,
                    now if retry_at is None else None,
                    now,
                    task_id,
                ),
            )

    def operator_resolve(
        self,
        task_id: str,
        outcome: Literal["done", "not-done"],
        by: str,
        *,
        observed: Any = None,
        note: str | None = None,
    ) -> TaskState:
        """An operator's answer for an ``unknown`` task (``broker-adapter reconcile``),
        audited under ``by``. It raises the fence, so a reconcile in flight is refused.

        Returns:
            the task's state afterwards.

        Raises:
            UnknownTask: no such task.
            StaleError: the task is not ``unknown``; nothing was written.
            ValueError: ``observed`` is not a JSON value within the result bounds.
        """
        encoded = check_result(observed).decode("utf-8") if outcome == "done" else None
        with self.db.write("reconcile_operator") as c:
            now = tx_now(c, self.clock)
            row = c.execute(
                "UPDATE tasks SET fence = fence + 1, owner = ?, lease_until = NULL,"
                " updated_at = ? WHERE task_id = ? AND state = 'unknown'"
                " RETURNING task_id, fence, attempts, max_attempts, deadline",
                (by, now, task_id),
            ).fetchone()
            if row is None:
                state = c.execute("SELECT state FROM tasks WHERE task_id = ?", (task_id,))
                found = state.fetchone()
                if found is None:
                    raise UnknownTask(task_id)
                raise StaleError(task_id, "not_unknown", f"state is {found['state']}")
            fence = int(row["fence"])
            if encoded is not None:
                self._done_in(c, task_id, by, fence, encoded, note, now)
                return TaskState.DONE
            return self._not_done_in(c, row, by, fence, observed, note, now)

    def reconcile_log(self, task_id: str) -> list[ReconcileRecord]:
        """The reconcile audit of one task, oldest first."""
        with self.db.read() as c:
            return reconcile_records(c, task_id)

    def _done_in(
        self,
        c: Conn,
        task_id: str,
        by: str,
        fence: int,
        encoded: str,
        note: str | None,
        now: float,
    ) -> str:
        log_reconcile(c, task_id, "done", by, fence, encoded, note, now, raw=True)
        effects = reply_member(c, task_id, "done", by, note)
        return to_terminal(c, task_id, TaskState.DONE, now, result=encoded, effects=effects)

    def _not_done_in(
        self,
        c: Conn,
        row: Any,
        by: str,
        fence: int,
        observed: Any,
        note: str | None,
        now: float,
    ) -> TaskState:
        task_id = row["task_id"]
        log_reconcile(c, task_id, "not-done", by, fence, observed, note, now)
        effects = reply_member(c, task_id, "not-done", by, note)
        if row["deadline"] <= now:
            error = "deadline reached; the reconcile found the effect not done"
            to_terminal(c, task_id, TaskState.EXPIRED, now, error=error, effects=effects)
            return TaskState.EXPIRED
        if row["attempts"] >= row["max_attempts"]:
            error = (
                "the reconcile found the effect not done; attempts exhausted "
                f"({row['attempts']}/{row['max_attempts']})"
            )
            to_terminal(c, task_id, TaskState.FAILED, now, error=error, effects=effects)
            return TaskState.FAILED
        c.execute(
            "UPDATE tasks SET state = 'pending', owner = NULL, lease_until = NULL,"
            " not_before = ?, operator_since = NULL, error = ?, updated_at = ?"
            " WHERE task_id = ?",
            (now, "the reconcile found the effect not done: retried", now, task_id),
        )
        return TaskState.PENDING

    # -- compensation ---------------------------------------------------------------------

    def begin_compensation(
        self, task_id: str, kind: str, owner: str, fence: int, what: str
    ) -> bool:
        """Take the one record of compensation ``kind`` for ``task_id``, as the holder of
        its reconcile. Returns True when this call made it (run the compensation, then
        ``end_compensation``), False when one was begun before (never run it again).

        Raises:
            StaleError: the caller does not hold the reconcile; nothing was written.
        """
        with self.db.write("compensation_begin") as c:
            now = tx_now(c, self.clock)
            unknown_holder(c, task_id, owner, fence, now)
            made = c.execute(
                "INSERT INTO compensations (task_id, kind, by_whom, fence, what, started_at,"
                " outcome, adapter_version, effect_key_digest) VALUES (?, ?, ?, ?, ?, ?,"
                f" 'started', ?, {EVIDENCE}) ON CONFLICT DO NOTHING",
                (task_id, kind, owner, fence, c.dialect.text(what), now, ADAPTER_VERSION, task_id),
            ).rowcount
            count_in(c, COMPENSATIONS + "started", made)
            return bool(made)

    def end_compensation(
        self, task_id: str, kind: str, outcome: CompensationOutcome, detail: str | None = None
    ) -> bool:
        """Record how a begun compensation ended. Returns False if it was not ``started``
        (never begun, or ended already)."""
        with self.db.write("compensation_end") as c:
            now = tx_now(c, self.clock)
            ended = c.execute(
                "UPDATE compensations SET outcome = ?, detail = ?, ended_at = ?"
                " WHERE task_id = ? AND kind = ? AND outcome = 'started'",
                (outcome, c.dialect.text(detail), now, task_id, kind),
            ).rowcount
            count_in(c, COMPENSATIONS + outcome, ended)
            return bool(ended)

    def compensations(self, task_id: str) -> list[CompensationRecord]:
        with self.db.read() as c:
            rows = c.execute(
                "SELECT task_id, kind, by_whom, fence, what, started_at, outcome, detail,"
                " ended_at FROM compensations WHERE task_id = ? ORDER BY started_at, kind",
                (task_id,),
            ).fetchall()
        return [CompensationRecord(**dict(r)) for r in rows]

    # -- counts ---------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """For ``status`` and metrics: ``effect_counts``."""
        with self.db.read() as c:
            return effect_counts(c)


def effect_counts(c: Conn) -> dict[str, int]:
    """``unknown`` tasks, those ``awaiting_operator``, and the counters that never fall
    (``counters.monotonic_counts``: reconciles by outcome, ``reconciled_<outcome>``;
    compensations begun and ended, ``compensations_<outcome>``; attempts; transitions to
    ``unknown``; operator timeouts), read in the caller's read transaction
    (``report.snapshot``)."""
    row = c.execute(
        "SELECT count(*) AS n, count(operator_since) AS waiting FROM tasks WHERE state = 'unknown'"
    ).fetchone()
    return {"unknown": row["n"], "awaiting_operator": row["waiting"], **monotonic_counts(c)}
