"""The inbox and the task state machine on PostgreSQL (``store.tasks.TaskStore``'s methods,
states, answers and crash points), for several adapter processes sharing one database.

Concurrency, where SQLite had one writer at a time:

* ``claim`` takes its tasks with ``FOR UPDATE SKIP LOCKED`` (oldest ready first): two
  workers on two hosts never take one task, and never wait for each other's rows. The
  reconciliation that runs first in each claim skips locked rows the same way.
* every fenced write (renew, done, failure) checks rule 10 (``docs/RULES.md``: fence,
  state ``running``, owner, lease unexpired, deadline not reached) in the WHERE clause of
  its UPDATE: the check and the row lock are one statement, so nothing can change the row
  between them. When it matches nothing, a read of the row gives the precise refusal and
  nothing was written.
* ``accept`` locks the identities of its batch first (``inbox.accept_in``).

A terminal state and its reply are written in one transaction (``lifecycle``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

from broker_adapter.clock import Clock, SystemClock
from broker_adapter.config import DEFAULT_LEASE_S
from broker_adapter.errors import StaleError
from broker_adapter.protocol.bounds import check_result
from broker_adapter.protocol.reply import reply_id_for
from broker_adapter.store import transitions
from broker_adapter.store.fencing import TASK_HELD_STATE, held_params, held_sql, refusal
from broker_adapter.store.inbox import (
    AcceptItem,
    AcceptResult,
    Intake,
    Outcome,
    conflict_reply_id,
    new_task_ids,
)
from broker_adapter.store.lifecycle import TERMINAL_STATES, TaskState
from broker_adapter.store.outbox import SentMark
from broker_adapter.store.postgres import settle
from broker_adapter.store.postgres.db import Conn, PgDatabase, Row
from broker_adapter.store.postgres.inbox import accept_in
from broker_adapter.store.postgres.lifecycle import reconcile_in, to_terminal
from broker_adapter.store.postgres.schema import CONFLICT_ID_KEY
from broker_adapter.store.retention import PURGE_BATCH, PurgeBatch, purge_requests, whole_pass
from broker_adapter.store.settle import FailOutcome, SettledBatch, Settlement
from broker_adapter.store.tasks import ClaimedTask, TaskPolicy, TaskRow, UnknownTask

_TASK_COLUMNS = ", ".join(TaskRow.__dataclass_fields__)
#: Held by (fence, owner) at now, before the deadline: the worker's side of rule 10
#: (``fencing``) in SQL.
TASK_HELD = held_sql(TASK_HELD_STATE, deadline=True, mark="%s")
_CLAIMED_COLUMNS = (
    "task_id, principal, message_id, kind, payload, attempts, max_attempts, fence, deadline,"
    " hops, correlation_id, parent_id, traceparent"
)


class PgTaskStore:
    """The inbox and the task state machine on one ``PgDatabase``.

    Args:
        db: the database (one pool per process).
        clock: time source (a ``FakeClock`` in tests).
        policy: leases, hop limit, retention, backoff.
        rng: randomness for backoff jitter.
    """

    def __init__(
        self,
        db: PgDatabase,
        clock: Clock | None = None,
        policy: TaskPolicy | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.db = db
        self.clock = clock or SystemClock()
        self.policy = policy or TaskPolicy()
        self.rng = rng or random.Random()
        self._conflict_id_key = db.meta(CONFLICT_ID_KEY)
        #: Expired leases this store took back (the ``ba_lease_takeovers_total`` metric).
        self.lease_takeovers = 0
        #: What the last reconcile took back, logged once its transaction committed.
        self._reconciled: list[transitions.Reconciled] = []

    def conflict_reply_id(self, principal: str, message_id: str, fingerprint: str) -> str:
        return conflict_reply_id(self._conflict_id_key, principal, message_id, fingerprint)

    # -- intake ---------------------------------------------------------------------------

    def accept(self, items: Sequence[AcceptItem]) -> list[AcceptResult]:
        """Record a batch of authenticated envelopes in one transaction."""
        return self.accept_and_claim(items, ()).results

    def accept_and_claim(
        self, items: Sequence[AcceptItem], claim_for: Sequence[tuple[str, int]]
    ) -> Intake:
        """``accept``, and in the same transaction a ``claim`` for each ``(owner, n)``."""
        now = self.clock.now()
        if not items:
            return Intake([], [[] for _ in claim_for])
        fingerprints = [item.envelope.fingerprint() for item in items]
        payloads = [item.envelope.payload_json() for item in items]
        ids = new_task_ids(len(items))
        with self.db.write("accept") as c:
            results = accept_in(self, c, items, now, fingerprints, payloads, ids)
            stored = any(r.outcome is Outcome.STORED for r in results)
            claimed = [
                [(r["task_id"], r["fence"]) for r in self._claim_in(c, owner, n, now)]
                if stored and n >= 1
                else []
                for owner, n in claim_for
            ]
        self._log_reconciled()
        transitions.accepted(items, results)
        return Intake(results, claimed)

    # -- workers --------------------------------------------------------------------------

    def claim(self, owner: str, n: int = 1) -> list[ClaimedTask]:
        """Hand up to ``n`` ready tasks to ``owner``: lease, attempts+1, fence+1; expired
        leases and deadlines are reconciled first, in the same transaction."""
        if n < 1:
            return []
        now = self.clock.now()
        with self.db.write("claim") as c:
            rows = self._claim_in(c, owner, n, now)
        self._log_reconciled()
        return self._claimed(rows, owner, now)

    def _claim_in(self, c: Conn, owner: str, n: int, now: float) -> list[Row]:
        """``claim``'s writes in the caller's transaction; rows in claim order."""
        self._reconcile(c, now)
        rows = c.execute(
            "UPDATE tasks t SET state = 'running', owner = %s, lease_until = %s,"
            " attempts = t.attempts + 1, fence = t.fence + 1, updated_at = %s"
            " FROM (SELECT task_id FROM tasks WHERE state = 'pending' AND not_before <= %s"
            "   ORDER BY not_before LIMIT %s FOR UPDATE SKIP LOCKED) AS picked"
            " WHERE t.task_id = picked.task_id"
            f" RETURNING {', '.join('t.' + name for name in _CLAIMED_COLUMNS.split(', '))},"
            " t.not_before, t.seq",
            (owner, now + self.policy.lease_s, now, now, n),
        ).fetchall()
        rows.sort(key=lambda r: (r["not_before"], r["seq"]))
        return rows

    def handed(self, owner: str, handles: Sequence[tuple[str, int]]) -> list[ClaimedTask]:
        """The tasks ``accept_and_claim`` claimed for ``owner`` (a read); a handle whose
        task moved on since (another fence) is left out."""
        if not handles:
            return []
        fences = dict(handles)
        with self.db.read() as c:
            rows = c.execute(
                f"SELECT {_CLAIMED_COLUMNS}, lease_until FROM tasks WHERE task_id = ANY(%s)"
                " AND state = 'running' AND owner = %s",
                (list(fences), owner),
            ).fetchall()
        by_id = {r["task_id"]: r for r in rows if fences[r["task_id"]] == r["fence"]}
        return [
            self._claimed_task(by_id[task_id], owner, float(by_id[task_id]["lease_until"]))
            for task_id, _ in handles
            if task_id in by_id
        ]

    def _claimed(self, rows: list[Row], owner: str, now: float) -> list[ClaimedTask]:
        lease_until = now + self.policy.lease_s
        return [self._claimed_task(r, owner, lease_until) for r in rows]

    @staticmethod
    def _claimed_task(r: Row, owner: str, lease_until: float) -> ClaimedTask:
        return ClaimedTask(
            task_id=r["task_id"], principal=r["principal"], message_id=r["message_id"],
            kind=r["kind"], payload=json.loads(r["payload"]), attempt=r["attempts"],
            max_attempts=r["max_attempts"], fence=r["fence"], owner=owner,
            lease_until=lease_until, deadline=float(r["deadline"]), hops=r["hops"],
            correlation_id=r["correlation_id"], parent_id=r["parent_id"],
            traceparent=r["traceparent"],
        )  # fmt: skip

    def _hold(self, c: Conn, task_id: str, owner: str, fence: int, assignments: str = "",
              params: Sequence[Any] = ()) -> Row:  # fmt: skip
        """Rule 10 as the WHERE clause of one UPDATE of ``task_id`` (``assignments``, or
        none: the UPDATE then only takes the row's lock), returning the row; raises the
        precise ``StaleError`` and writes nothing when ``owner`` does not hold it."""
        now = self.clock.now()
        sets = assignments or "fence = fence"
        row = c.execute(
            f"UPDATE tasks SET {sets} WHERE task_id = %s AND {TASK_HELD}"
            " RETURNING state, owner, fence, lease_until, deadline, attempts, max_attempts,"
            " principal, message_id, correlation_id, traceparent",
            (*params, task_id, *held_params(fence, owner, now, deadline=True)),
        ).fetchone()
        if row is None:
            raise self._why_not(c, task_id, owner, fence, now)
        return row

    def _why_not(
        self, c: Conn, task_id: str, owner: str, fence: int, now: float
    ) -> StaleError | UnknownTask:
        """Why a fenced UPDATE of ``task_id`` matched nothing (``UnknownTask`` if no row)."""
        row = c.execute(
            "SELECT state, owner, fence, lease_until, deadline FROM tasks WHERE task_id = %s",
            (task_id,),
        ).fetchone()
        if row is None:
            return UnknownTask(task_id)
        why = refusal(row, task_id, owner, fence, now, state=TASK_HELD_STATE, deadline=True)
        return why or StaleError(task_id, "lease_expired")  # the clock moved on meanwhile

    def renew(self, task_id: str, owner: str, fence: int) -> float:
        """Extend the lease by ``policy.lease_s`` (fenced); returns the new ``lease_until``."""
        now = self.clock.now()
        lease_until = now + self.policy.lease_s
        with self.db.write("renew") as c:
            self._hold(c, task_id, owner, fence, "lease_until = %s, updated_at = %s",
                       (lease_until, now))  # fmt: skip
        return lease_until

    def finish(self, task_id: str, owner: str, fence: int, result: Any) -> str:
        """Commit success: state ``done`` and its reply, in one transaction (fenced)."""
        encoded = check_result(result).decode("utf-8")
        item = Settlement(task_id, owner, fence, result=encoded)
        (out,) = settle.settle(self, [item], "", 0).results
        if isinstance(out, StaleError):
            raise out
        assert isinstance(out, str)
        return out

    def fail(
        self, task_id: str, owner: str, fence: int, error: str, *, retryable: bool
    ) -> FailOutcome:
        """Record a failed attempt (fenced); see ``TaskStore.fail``."""
        item = Settlement(task_id, owner, fence, error=error, retryable=retryable)
        (out,) = settle.settle(self, [item], "", 0, op="fail").results
        if isinstance(out, StaleError):
            raise out
        assert isinstance(out, FailOutcome)
        return out

    def settle_batch(
        self, items: Sequence[Settlement], owner: str, n: int, *,
        publish_as: str | None = None, publish_lease_s: float = DEFAULT_LEASE_S,
        sent: Sequence[SentMark] = (),
    ) -> SettledBatch:  # fmt: skip
        """Commit a batch of outcomes (each fenced) and claim the next batch, in ONE
        transaction (``settle.settle``)."""
        return settle.settle(
            self, items, owner, n, publish_as=publish_as, publish_lease_s=publish_lease_s,
            sent=sent,
        )  # fmt: skip

    def has_work(self) -> bool:
        """Whether a claim would find something now (a read)."""
        now = self.clock.now()
        row = self.db.fetch_one(
            "SELECT EXISTS (SELECT 1 FROM tasks WHERE state = 'pending' AND not_before <= %s)"
            " OR EXISTS (SELECT 1 FROM tasks WHERE state = 'running' AND lease_until <= %s)"
            " AS work",
            (now, now),
        )
        return row is not None and bool(row["work"])

    def cancel(self, task_id: str, reason: str = "cancelled") -> TaskState:
        """Cancel a live task durably (with its reply); its holder is fenced out."""
        now = self.clock.now()
        with self.db.write("cancel") as c:
            row = c.execute(
                "SELECT state FROM tasks WHERE task_id = %s FOR UPDATE", (task_id,)
            ).fetchone()
            if row is None:
                raise UnknownTask(task_id)
            state = TaskState(row["state"])
            if state in TERMINAL_STATES:
                return state
            to_terminal(c, task_id, TaskState.CANCELLED, now, error=reason)
        transitions.task_transition("cancelled", task_id, "cancelled", detail=reason,
                                    reply_id=reply_id_for(task_id))  # fmt: skip
        return TaskState.CANCELLED

    def refusal(self, task_id: str, owner: str, fence: int) -> StaleError | None:
        """Whether ``owner`` still holds ``task_id`` under ``fence`` (one read), the
        deadline left to the caller."""
        row = self.db.fetch_one(
            "SELECT state, owner, fence, lease_until, deadline FROM tasks WHERE task_id = %s",
            (task_id,),
        )
        if row is None:
            return StaleError(task_id, "not_running", "no such task")
        return refusal(
            row, task_id, owner, fence, self.clock.now(), state=TASK_HELD_STATE, deadline=False
        )

    def is_cancelled(self, task_id: str) -> bool:
        row = self.db.fetch_one("SELECT state FROM tasks WHERE task_id = %s", (task_id,))
        return row is not None and row["state"] == TaskState.CANCELLED

    # -- housekeeping ---------------------------------------------------------------------

    def reconcile(self) -> dict[str, int]:
        """Apply the clock: expire deadlines, take back expired leases."""
        with self.db.write("reconcile") as c:
            counts = self._reconcile(c, self.clock.now())
        self._log_reconciled()
        return counts

    def _log_reconciled(self) -> None:
        taken, self._reconciled = self._reconciled, []
        transitions.reconciled(taken)

    def _reconcile(self, c: Conn, now: float) -> dict[str, int]:
        taken: list[transitions.Reconciled] = []  # logged once the caller's transaction commits
        self._reconciled = taken
        counts = reconcile_in(c, now, taken)
        self.lease_takeovers += counts["requeued"] + counts["exhausted"]
        return counts

    def purge_batch(self, after: int = 0, limit: int = PURGE_BATCH) -> PurgeBatch:
        """Forget at most ``limit`` requests past the retention window (``retention``)."""
        return purge_requests(self.db, self.clock.now(), self.policy.retention_s, after, limit)

    def purge(self, limit: int = PURGE_BATCH) -> int:
        return whole_pass(lambda after: self.purge_batch(after, limit)).requests

    # -- reads ----------------------------------------------------------------------------

    def get(self, task_id: str) -> TaskRow | None:
        row = self.db.fetch_one(f"SELECT {_TASK_COLUMNS} FROM tasks WHERE task_id = %s", (task_id,))
        return TaskRow(**row) if row else None

    def find(self, principal: str, message_id: str) -> TaskRow | None:
        row = self.db.fetch_one(
            f"SELECT {', '.join('t.' + n for n in TaskRow.__dataclass_fields__)}"
            " FROM inbox i JOIN tasks t ON t.task_id = i.task_id"
            " WHERE i.principal = %s AND i.message_id = %s",
            (principal, message_id),
        )
        return TaskRow(**row) if row else None

    def open_counts(self) -> dict[str, int]:
        with self.db.read() as c:
            rows = c.execute(
                "SELECT principal, count(*) AS n FROM tasks"
                " WHERE state IN ('pending', 'running') GROUP BY principal"
            ).fetchall()
        return {r["principal"]: r["n"] for r in rows}

    def counts(self) -> dict[str, int]:
        with self.db.read() as c:
            rows = c.execute("SELECT state, count(*) AS n FROM tasks GROUP BY state").fetchall()
        out = {s.value: 0 for s in TaskState}
        out.update({r["state"]: r["n"] for r in rows})
        return out
