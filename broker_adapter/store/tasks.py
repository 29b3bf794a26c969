"""The task state machine: claims, leases and fences, on the inbox's tasks.

States and arrows: ``lifecycle``. A claim sets owner, lease, attempts+1 and fence+1 in one
short transaction (after ``housekeeping.reconcile_in``); renew and settlement succeed only
while the task is running, owner and fence match, the lease is unexpired and the deadline
not reached (``fencing``, ``docs/RULES.md`` rule 10), so an expired lease is fenced even
before anyone reclaims it. A refused write raises (or reports) ``StaleError`` and writes
nothing.

``TaskStore`` is the one object the stages use: intake is
``inbox``'s, outcomes are ``settle``'s, deadlines and leases ``housekeeping``'s, and the
claim, the holder check, the take-back and the outright cancel are ``task_tx.TaskTx``'s
(the store's ``tx``, which those modules and the effect and approval records take); this
module holds renew and the reads.

Retries never extend the absolute deadline. Attempts are counted in the claim transaction,
before any handler runs, so a task whose handler kills its worker still spends its budget.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from broker_adapter.clock import Clock, SystemClock
from broker_adapter.config import DEFAULT_LEASE_S
from broker_adapter.errors import StaleError, TaskCancelled
from broker_adapter.protocol.bounds import check_result
from broker_adapter.store import inbox, settle
from broker_adapter.store.db import Database
from broker_adapter.store.dbclock import read_now, tx_now
from broker_adapter.store.inbox import (
    AcceptItem,
    AcceptResult,
    Intake,
    conflict_reply_id,
)
from broker_adapter.store.migrations import CONFLICT_ID_KEY
from broker_adapter.store.outbox_types import SentMark
from broker_adapter.store.retention import (
    PURGE_BATCH,
    PurgeBatch,
    purge_requests,
    whole_pass,
)
from broker_adapter.store.settle import FailOutcome, SettledBatch, Settlement
from broker_adapter.store.sql import in_lists
from broker_adapter.store.task_tx import TaskTx
from broker_adapter.store.task_types import (
    CLAIM_COLUMNS,
    CLOCKED_SQL,
    TASK_COLUMNS,
    ClaimedTask,
    TaskPolicy,
    TaskRow,
    TaskState,
    claimed_task,
)

if TYPE_CHECKING:
    from broker_adapter.store.postgres.db import PgDatabase


class TaskStore:
    """The inbox and the task state machine on one database: a SQLite ``Database`` or a
    ``PgDatabase`` that several processes share (the same statements, ``store.sql``).

    Args:
        db: the database (one per process).
        clock: time source (a ``FakeClock`` in tests).
        policy: leases, hop limit, retention, backoff.
        rng: randomness for backoff jitter.
    """

    def __init__(
        self,
        db: Database | PgDatabase,
        clock: Clock | None = None,
        policy: TaskPolicy | None = None,
        rng: random.Random | None = None,
    ) -> None:
        #: The claim, the holder check and the take-back, for the transactions of this
        #: store's modules (``task_tx``).
        self.tx = TaskTx(db, clock or SystemClock(), policy or TaskPolicy(), rng or random.Random())
        self.conflict_key = db.meta(CONFLICT_ID_KEY)

    @property
    def db(self) -> Database | PgDatabase:
        return self.tx.db

    @property
    def clock(self) -> Clock:
        return self.tx.clock

    @property
    def policy(self) -> TaskPolicy:
        return self.tx.policy

    @property
    def rng(self) -> random.Random:
        """Randomness for backoff jitter (a seeded one in tests)."""
        return self.tx.rng

    @rng.setter
    def rng(self, rng: random.Random) -> None:
        self.tx.rng = rng

    @property
    def lease_takeovers(self) -> int:
        """Expired leases this store took back (``TaskTx.lease_takeovers``): the
        ``ba_lease_takeovers_total`` metric."""
        return self.tx.lease_takeovers

    def conflict_reply_id(self, principal: str, message_id: str, fingerprint: str) -> str:
        """The id of the conflict answer to ``(principal, message_id)`` reused with content
        ``fingerprint``, in this database (``conflict_reply_id`` with its key)."""
        return conflict_reply_id(self.conflict_key, principal, message_id, fingerprint)

    # -- intake (``inbox``) ---------------------------------------------------------------

    def accept(self, items: Sequence[AcceptItem]) -> list[AcceptResult]:
        """Record a batch of authenticated envelopes in one transaction.

        Returns:
            one ``AcceptResult`` per item, in order. Items are independent: a conflict in
            one does not affect the others. Nothing is written for ``CONFLICT``'s stored
            request; its answer goes to the outbox under a stable conflict reply id.
        """
        return self.accept_and_claim(items, ()).results

    def accept_and_claim(
        self, items: Sequence[AcceptItem], claim_for: Sequence[tuple[str, int]]
    ) -> Intake:
        """``accept``, and in the same transaction a ``claim`` of up to ``n`` ready tasks
        for each ``(owner, n)`` of ``claim_for`` (``inbox.accept_and_claim``)."""
        return inbox.accept_and_claim(self.tx, self.conflict_key, items, claim_for)

    # -- workers --------------------------------------------------------------------------

    def claim(self, owner: str, n: int = 1) -> list[ClaimedTask]:
        """Hand up to ``n`` ready tasks to ``owner``: lease, attempts+1, fence+1.

        Expired leases and deadlines are reconciled first, in the same transaction.
        """
        if n < 1:
            return []
        with self.db.write("claim") as c:
            now = tx_now(c, self.clock)
            rows = self.tx.claim_in(c, owner, n, now)
        self.tx.log_reconciled()
        return self.tx.claimed(rows, owner, now)

    def handed(self, owner: str, handles: Sequence[tuple[str, int]]) -> list[ClaimedTask]:
        """The tasks ``accept_and_claim`` claimed for ``owner``, as its own ``claim`` would
        have returned them; a read (no write lock). A handle whose task moved on since
        (its lease expired and another worker claimed it: another fence) is left out.
        """
        if not handles:
            return []
        fences = dict(handles)
        by_id: dict[str, Any] = {}
        with self.db.read() as c:
            for chunk, placeholders in in_lists(list(fences)):
                for r in c.execute(
                    f"SELECT {CLAIM_COLUMNS}, lease_until"
                    f" FROM tasks WHERE task_id IN ({placeholders})"
                    " AND state = 'running' AND owner = ?",
                    (*chunk, owner),
                ).fetchall():
                    if fences[r["task_id"]] == r["fence"]:
                        by_id[r["task_id"]] = r
        return [
            claimed_task(by_id[task_id], owner, float(by_id[task_id]["lease_until"]))
            for task_id, _ in handles
            if task_id in by_id
        ]

    def renew(self, task_id: str, owner: str, fence: int) -> float:
        """Extend the lease by ``policy.lease_s``.

        Returns:
            the new ``lease_until``.

        Raises:
            TaskCancelled: the task was cancelled; stop work.
            StaleError: the lease is lost (fence, owner, expiry, deadline).
        """
        with self.db.write("renew") as c:
            now = tx_now(c, self.clock)
            lease_until = now + self.policy.lease_s
            row = self.tx.holder(c, task_id, owner, fence)
            requested = row["cancel_requested_at"]
            if requested is not None and now >= requested + self.policy.cancel_grace_s:
                raise TaskCancelled(task_id)  # the grace of a requested cancel is over
            c.execute(
                "UPDATE tasks SET lease_until = ?, updated_at = ? WHERE task_id = ? AND fence = ?",
                (lease_until, now, task_id, fence),
            )
        return lease_until

    # -- outcomes (``settle``) ------------------------------------------------------------

    def settle_batch(
        self,
        items: Sequence[Settlement],
        owner: str,
        n: int,
        *,
        publish_as: str | None = None,
        publish_lease_s: float = DEFAULT_LEASE_S,
        sent: Sequence[SentMark] = (),
    ) -> SettledBatch:
        """Commit a batch of outcomes, each fenced, and claim the next batch (like
        ``claim(owner, n)``; nothing when ``n`` is 0) in ONE transaction: ``settle.settle``,
        where the arguments and results are described."""
        return settle.settle(
            self.tx,
            items,
            owner,
            n,
            publish_as=publish_as,
            publish_lease_s=publish_lease_s,
            sent=sent,
        )

    def finish(self, task_id: str, owner: str, fence: int, result: Any) -> str:
        """Commit one success: ``settle_batch`` of one ``done`` outcome, its refusal raised.

        Args:
            result: any JSON value within the result bounds (``bounds.check_result``);
                stored canonically and carried in the reply.

        Returns:
            the reply id.

        Raises:
            StaleError: refused; nothing is written.
            ValueError: ``result`` is not JSON (NaN, a set, ...), or an ``EnvelopeError``
                for a result over the bounds; nothing is written.
        """
        encoded = check_result(result).decode("utf-8")
        (out,) = self.settle_batch(
            [Settlement(task_id, owner, fence, result=encoded)], "", 0
        ).results
        if isinstance(out, StaleError):
            raise out
        assert isinstance(out, str)
        return out

    def fail(
        self, task_id: str, owner: str, fence: int, error: str, *, retryable: bool
    ) -> FailOutcome:
        """Record one failed attempt: ``settle_batch`` of one failure, its refusal raised
        (in a transaction named ``fail``).

        A retryable failure with attempts left, and time left before the deadline after the
        backoff, goes back to ``pending``; anything else ends ``failed`` with its reply.

        Raises:
            StaleError: refused; nothing is written.
        """
        item = Settlement(task_id, owner, fence, error=error, retryable=retryable)
        (out,) = settle.settle(self.tx, [item], "", 0, op="fail").results
        if isinstance(out, StaleError):
            raise out
        assert isinstance(out, FailOutcome)
        return out

    def has_work(self) -> bool:
        """Whether a claim would find something now: a ready pending task or an expired
        lease. A read (no write lock, no fsync): idle workers ask this before claiming."""
        now = read_now(self.db, self.clock)
        d = self.db.dialect
        row = self.db.fetch_one(
            f"SELECT EXISTS (SELECT 1 FROM tasks{d.indexed_by('tasks_ready')}"
            " WHERE state = 'pending' AND not_before <= ?)"
            f" OR EXISTS (SELECT 1 FROM tasks{d.indexed_by('tasks_leases')}"
            " WHERE state = 'running' AND lease_until <= ?) AS work",
            (now, now),
        )
        return row is not None and bool(row["work"])

    def cancel(self, task_id: str, reason: str = "cancelled") -> TaskState:
        """Cancel a live task durably, with its reply (``TaskTx.cancel``).

        Raises:
            UnknownTask: no such task.
        """
        return self.tx.cancel(task_id, reason)

    def refusal(self, task_id: str, owner: str, fence: int) -> StaleError | None:
        """Whether ``owner`` still holds ``task_id`` under ``fence`` (``TaskTx.refusal``):
        the refusal, or None while it holds."""
        return self.tx.refusal(task_id, owner, fence)

    def reconcile(self) -> dict[str, int]:
        """Apply the clock: expire deadlines, take back expired leases
        (``housekeeping.reconcile_in``).

        Returns:
            counts by what happened: ``expired``, ``requeued``, ``exhausted``.
        """
        with self.db.write("reconcile") as c:
            counts = self.tx.reconcile_in(c, tx_now(c, self.clock))
        self.tx.log_reconciled()
        return counts

    def purge_batch(self, after: int = 0, limit: int = PURGE_BATCH) -> PurgeBatch:
        """Forget at most ``limit`` requests past the retention window, with everything
        kept for them (task, inbox record, reply), in one short transaction; see
        ``retention`` for the rule and ``PurgeBatch.after`` / ``more`` for the pass."""
        now = read_now(self.db, self.clock)  # the server's on PostgreSQL (``dbclock``)
        return purge_requests(self.db, now, self.policy.retention_s, after, limit)

    def purge(self, limit: int = PURGE_BATCH) -> int:
        """A whole purge pass, batch after batch (no pause: the runner's purger spaces its
        batches with ``PurgeSchedule``). Returns how many requests were forgotten."""
        return whole_pass(lambda after: self.purge_batch(after, limit)).requests

    # -- reads ----------------------------------------------------------------------------

    def get(self, task_id: str) -> TaskRow | None:
        with self.db.read() as c:
            row = c.execute(
                f"SELECT {TASK_COLUMNS} FROM tasks WHERE task_id = ?", (task_id,)
            ).fetchone()
        return TaskRow(**dict(row)) if row else None

    def find(self, principal: str, message_id: str) -> TaskRow | None:
        with self.db.read() as c:
            row = c.execute(
                f"SELECT {', '.join('t.' + n for n in TaskRow.__dataclass_fields__)}"
                " FROM inbox i JOIN tasks t ON t.task_id = i.task_id"
                " WHERE i.principal = ? AND i.message_id = ?",
                (principal, message_id),
            ).fetchone()
        return TaskRow(**dict(row)) if row else None

    def stored_message_ids(self, principal: str, message_ids: Sequence[str]) -> set[str]:
        """Which of ``message_ids`` of ``principal`` the inbox holds already (the ingest's
        limits charge nothing for a duplicate of a stored request): one indexed lookup per
        ``IN_LIST_CHUNK`` ids."""
        found: set[str] = set()
        with self.db.read() as c:
            for chunk, places in in_lists(list(dict.fromkeys(message_ids))):
                sql = "SELECT message_id FROM inbox WHERE principal = ? AND message_id IN "
                rows = c.execute(f"{sql}({places})", (principal, *chunk)).fetchall()
                found.update(r["message_id"] for r in rows)
        return found

    def open_counts(self) -> dict[str, int]:
        """Tasks not yet terminal (pending or running) per principal, for the ingest's
        quota (``limits``): one pass over the live tasks' partial index."""
        with self.db.read() as c:
            rows = c.execute(
                f"SELECT principal, count(*) AS n FROM tasks"
                f"{c.dialect.indexed_by('tasks_live_deadline')}"
                f" WHERE state IN {CLOCKED_SQL} GROUP BY principal"
            ).fetchall()
        return {r["principal"]: r["n"] for r in rows}

    def counts(self) -> dict[str, int]:
        with self.db.read() as c:
            rows = c.execute("SELECT state, count(*) AS n FROM tasks GROUP BY state").fetchall()
        out = {s.value: 0 for s in TaskState}
        out.update({r["state"]: r["n"] for r in rows})
        return out
