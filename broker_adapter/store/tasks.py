"""The inbox and the task state machine.

::

    accept ──> pending ──claim──> running ──finish──> done
                  ^                  │ ──fail(retryable, budget left)──> pending (backoff)
                  └──lease expired───┤ ──fail / budget spent──> failed
                                     │ ──deadline reached──> expired
               cancel (any live) ────┴──> cancelled          hops > limit at accept ──> hop_limit
    reserved, not reached yet: unknown (outcome of an external effect not known),
                               waiting_approval (needs a separate authorization record)

Every arrow into a terminal state writes the task's one reply into the outbox in the same
transaction. A claim sets owner, lease, attempts+1 and fence+1 in one short transaction;
renew / finish / fail succeed only while the task is running, owner and fence match, the
lease is unexpired and the deadline not reached, so an expired lease is fenced even before
anyone reclaims it. A refused write raises ``StaleError`` and rolls back: nothing is written.

Retries never extend the absolute deadline. Attempts are counted in the claim transaction,
before any handler runs, so a task whose handler kills its worker still spends its budget.
"""

from __future__ import annotations

import hmac
import json
import os
import random
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

from pydantic import Field

from broker_adapter.backoff import Backoff
from broker_adapter.clock import Clock, SystemClock
from broker_adapter.config import ConfigModel
from broker_adapter.errors import (
    BrokerAdapterError,
    EnvelopeError,
    FencedError,
    StaleError,
    TaskCancelled,
)
from broker_adapter.protocol.envelope import Envelope, check_result, sha256_hex
from broker_adapter.store import transitions
from broker_adapter.store.db import CONFLICT_ID_KEY, Database, in_lists
from broker_adapter.store.outbox import (
    OutboxRow,
    PublisherClaim,
    SentMark,
    encode_body,
    enqueue,
    enqueue_encoded,
    mark_sent_in,
)
from broker_adapter.store.retention import (
    DEFAULT_RETENTION_S,
    PURGE_BATCH,
    PurgeBatch,
    purge_requests,
    whole_pass,
)


class TaskState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    HOP_LIMIT = "hop_limit"
    UNKNOWN = "unknown"
    WAITING_APPROVAL = "waiting_approval"


TERMINAL_STATES = frozenset(
    {TaskState.DONE, TaskState.FAILED, TaskState.CANCELLED, TaskState.EXPIRED, TaskState.HOP_LIMIT}
)
LIVE_STATES = frozenset({TaskState.PENDING, TaskState.RUNNING, TaskState.WAITING_APPROVAL})


class Outcome(StrEnum):
    """What ``accept`` did with one envelope."""

    STORED = "stored"  # a new pending task
    DUPLICATE = "duplicate"  # same identity, same content: the earlier task id
    CONFLICT = "conflict"  # same identity, other content: refused, stored row untouched
    EXPIRED = "expired"  # deadline already past: terminal at once, with its reply
    HOP_LIMIT = "hop_limit"  # too many hops: terminal at once, with its reply
    NOT_TASK = "not_task"  # kind is not "task": nothing written, caller dead-letters it
    # A rule only the accepting store can check (a deadline beyond the retention window):
    # nothing written, the caller dead-letters it with ``AcceptResult.refusal``.
    REFUSED = "refused"


class FailOutcome(StrEnum):
    RETRY = "retry"
    FAILED = "failed"


class TaskPolicy(ConfigModel):
    """Limits of the task state machine.

    Attributes:
        lease_s: lease granted by ``claim`` and ``renew``.
        max_hops: envelopes with more hops are accepted straight into ``hop_limit``.
        retention_s: how long an inbox record dedupes its (principal, message_id); past it,
            once the task is terminal and its deadline has passed, a reused id is a new
            request. It also bounds deadlines: one further ahead than this is refused, so
            that no request outlives the record that makes its replay a duplicate.
        backoff: delay before a retryable failure runs again.

    Raises:
        ConfigError: a lease or retention not above 0, or a negative ``max_hops``.
    """

    lease_s: float = Field(default=30.0, gt=0)
    max_hops: int = Field(default=16, ge=0)
    retention_s: float = Field(default=DEFAULT_RETENTION_S, gt=0)
    backoff: Backoff = Field(default_factory=Backoff)


class AcceptItem(NamedTuple):
    """One authenticated envelope. ``principal`` must come from a verified check."""

    principal: str
    envelope: Envelope
    entry_id: str | None = None


class AcceptResult(NamedTuple):
    """What ``accept`` did with one item (a tuple: one is made per stream entry).

    ``refusal`` is set for ``NOT_TASK`` and ``REFUSED``: the envelope rule it breaks, with
    the field and reason its dead letter carries."""

    outcome: Outcome
    task_id: str | None = None
    reply_id: str | None = None
    detail: str = ""
    refusal: EnvelopeError | None = None


@dataclass(frozen=True)
class ClaimedTask:
    """A task handed to one worker, with the fence that worker must present."""

    task_id: str
    principal: str
    message_id: str
    kind: str
    payload: dict[str, Any]
    attempt: int
    max_attempts: int
    fence: int
    owner: str
    lease_until: float
    deadline: float
    hops: int
    correlation_id: str | None
    parent_id: str | None

    @property
    def idempotency_key(self) -> str:
        """Stable across attempts, fences and tasks of one request: key external effects
        by this. See ``idempotency_key_for``."""
        return idempotency_key_for(self.principal, self.message_id)


class Intake(NamedTuple):
    """What ``TaskStore.accept_and_claim`` did: the accept results, in item order, and per
    owner asked for the ``(task_id, fence)`` handles claimed for it."""

    results: list[AcceptResult]
    claimed: list[list[tuple[str, int]]]


@dataclass(frozen=True)
class Settlement:
    """One handler outcome for ``settle_many``: ``done`` when ``result`` (canonical JSON
    text) is set, otherwise a failure with ``error`` (back to ``pending`` if ``retryable``
    and the budget and deadline allow)."""

    task_id: str
    owner: str
    fence: int
    result: str | None = None
    error: str | None = None
    retryable: bool = False
    claimed: ClaimedTask | None = None  # lets ``settle_many`` encode the reply up front


#: What ``settle_many`` did with one item: reply id, failure outcome, or the refusal.
SettleResult = str | FailOutcome | StaleError


@dataclass(frozen=True)
class SettledBatch:
    """What ``settle_batch`` did, in its one transaction.

    Attributes:
        results: one per item, as ``settle_and_claim`` returns them.
        claimed: the tasks claimed for the next batch.
        replies: the terminal replies written already claimed by ``publish_as`` (state
            ``sending``, its lease, fence 1), to be published by it now.
        marks: one per ``sent`` mark: ``None`` when marked sent, else the refusal.
    """

    results: list[SettleResult]
    claimed: list[ClaimedTask]
    replies: list[OutboxRow] = field(default_factory=list)
    marks: list[StaleError | None] = field(default_factory=list)


@dataclass(frozen=True)
class TaskRow:
    task_id: str
    principal: str
    message_id: str
    state: str
    attempts: int
    max_attempts: int
    fence: int
    owner: str | None
    lease_until: float | None
    deadline: float
    not_before: float
    created_at: float
    finished_at: float | None
    result: str | None
    error: str | None


_TASK_COLUMNS = ", ".join(TaskRow.__dataclass_fields__)


class UnknownTask(BrokerAdapterError, KeyError):
    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        super().__init__(f"no task {task_id!r}")


def idempotency_key_for(principal: str, message_id: str) -> str:
    """The idempotency key of a request: ``"ba:"`` and the first 32 hex digits of
    SHA-256 over the UTF-8 of ``principal``, a NUL byte and ``message_id``.

    Derived from the request's identity, not from its task: a second task for the same
    request (a replay accepted anew after the retention window, a message id reused once
    it was forgotten) carries the same key, so an effect keyed by it is applied once.
    Neither part can hold a NUL (principals are letters, digits, ``._-``; message ids
    have no control characters), so distinct identities give distinct inputs.
    """
    digest = sha256_hex(f"{principal}\0{message_id}".encode())
    return f"ba:{digest[:32]}"


def reply_id_for(task_id: str) -> str:
    """The stable reply id of a task's terminal reply."""
    return f"r-{task_id}"


def conflict_reply_id(key: bytes, principal: str, message_id: str, fingerprint: str) -> str:
    """A stable id for the "conflict" answer to one (identity, other content) pair.

    An HMAC with the database's own random key (``meta`` row ``CONFLICT_ID_KEY``, see
    ``TaskStore.conflict_reply_id``): the same pair always gets the same id, so a repeated
    conflict is the same answer, but nobody without the key can compute it from the
    request's public fields and publish something under it ahead of the real answer.
    """
    message = f"ba.conflict.v1\0{principal}\0{message_id}\0{fingerprint}".encode()
    return f"c-{hmac.digest(key, message, 'sha256').hex()[:32]}"


def new_task_ids(n: int) -> list[str]:
    """``n`` task ids of 32 hex digits: the wall-clock millisecond (48 bits), then 80
    random bits, from one read of the OS's random source (one system call per batch).

    Time-ordered so that new rows land at the end of the task-id (and reply-id) indexes
    rather than all over them: fewer pages touched per accept transaction, a smaller WAL.
    The clock only orders ids; uniqueness rests on the random part.
    """
    stamp = f"{time.time_ns() // 1_000_000 & 0xFFFF_FFFF_FFFF:012x}"
    bits = os.urandom(10 * n).hex()
    return [stamp + bits[i : i + 20] for i in range(0, 20 * n, 20)]


_INSERT_TASK = (
    "INSERT INTO tasks (task_id, principal, message_id, kind, payload, fingerprint,"
    " correlation_id, parent_id, state, max_attempts, not_before, deadline, hops,"
    " created_at, updated_at, finished_at, error)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
# A reused id past the retention window (its task terminal) takes the record over.
_UPSERT_INBOX = (
    "INSERT INTO inbox (principal, message_id, fingerprint, task_id, entry_id, received_at)"
    " VALUES (?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (principal, message_id) DO UPDATE SET fingerprint = excluded.fingerprint,"
    " task_id = excluded.task_id, entry_id = excluded.entry_id,"
    " received_at = excluded.received_at, duplicates = 0, conflicts = 0"
)


@dataclass
class _AcceptBatch:
    """What one ``accept`` transaction decided, written by ``write`` in bulk and in order:
    new tasks, their inbox records, duplicate counters, then the rarer writes (conflict
    answers, terminal replies) in the order they were decided."""

    known: dict[tuple[str, str], Mapping[str, Any]]
    parent_hops: dict[str, int]
    #: Fresh task ids, one per item of the batch at most (drawn in one go).
    ids: Iterator[str]
    tasks: list[tuple[Any, ...]] = field(default_factory=list)
    inbox: list[tuple[Any, ...]] = field(default_factory=list)
    duplicates: list[tuple[str, str]] = field(default_factory=list)
    then: list[Callable[[sqlite3.Connection], object]] = field(default_factory=list)

    def write(self, c: sqlite3.Connection) -> None:
        if self.tasks:
            c.executemany(_INSERT_TASK, self.tasks)
            c.executemany(_UPSERT_INBOX, self.inbox)
        if self.duplicates:
            c.executemany(
                "UPDATE inbox SET duplicates = duplicates + 1"
                " WHERE principal = ? AND message_id = ?",
                self.duplicates,
            )
        for op in self.then:
            op(c)


def _hops(env: Envelope, parent_hops: Mapping[str, int]) -> int:
    """Hops as the system counts them (``docs/RULES.md`` rule 12): a request whose ``parent_id``
    names a task of ours is one hop further than that task, whatever its body says; the
    body's figure can only add hops, never remove them."""
    if env.parent_id is None:
        return env.hops
    parent = parent_hops.get(env.parent_id)
    return env.hops if parent is None else max(env.hops, parent + 1)


class TaskStore:
    """The inbox and the task state machine on one ``Database``.

    Args:
        db: the database (one per process).
        clock: time source (a ``FakeClock`` in tests).
        policy: leases, hop limit, retention, backoff.
        rng: randomness for backoff jitter.
    """

    def __init__(
        self,
        db: Database,
        clock: Clock | None = None,
        policy: TaskPolicy | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.db = db
        self.clock = clock or SystemClock()
        self.policy = policy or TaskPolicy()
        self.rng = rng or random.Random()
        self._conflict_id_key = db.meta(CONFLICT_ID_KEY)
        #: Expired leases this store took back (requeued or failed on the last attempt),
        #: counted in the reconciling transaction (one that then fails counts them again
        #: when it is retried): the ``ba_lease_takeovers_total`` metric.
        self.lease_takeovers = 0
        #: what the last reconcile did, logged after its transaction (``transitions``)
        self._reconciled: list[transitions.Reconciled] = []

    def conflict_reply_id(self, principal: str, message_id: str, fingerprint: str) -> str:
        """The id of the conflict answer to ``(principal, message_id)`` reused with content
        ``fingerprint``, in this database (``conflict_reply_id`` with its key)."""
        return conflict_reply_id(self._conflict_id_key, principal, message_id, fingerprint)

    # -- intake ---------------------------------------------------------------------------

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
        for each ``(owner, n)`` of ``claim_for``, in that order: the ingest hands new tasks
        to idle workers without a claim transaction of theirs (``handoff.Handoff``). The
        claims are the very claims ``claim`` makes (reconcile first, oldest ready first,
        lease, attempts+1, fence+1); each owner takes them up with ``handed``.

        Returns:
            the ``accept`` results, and per owner of ``claim_for`` the ``(task_id, fence)``
            handles it claimed (possibly none).
        """
        now = self.clock.now()
        if not items:
            return Intake([], [[] for _ in claim_for])
        # Hash and encode before taking the write lock: the transaction holds it for SQL only.
        fingerprints = [item.envelope.fingerprint() for item in items]
        payloads = [item.envelope.payload_json() for item in items]
        ids = new_task_ids(len(items))
        with self.db.write("accept") as c:
            batch = _AcceptBatch(
                known=self._prefetch(c, items),
                parent_hops=self._parent_hops(c, items),
                ids=iter(ids),
            )
            results = [
                self._accept_one(batch, item, now, fingerprint, payload)
                for item, fingerprint, payload in zip(items, fingerprints, payloads, strict=True)
            ]
            batch.write(c)
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

    @staticmethod
    def _prefetch(
        c: sqlite3.Connection, items: Sequence[AcceptItem]
    ) -> dict[tuple[str, str], Mapping[str, Any]]:
        """The inbox records of a whole batch, looked up in a few queries, not one per item.

        One query per principal and chunk, ``principal = ? AND message_id IN (...)``: a
        search of the primary key (a row-value ``IN (VALUES ...)`` would scan the inbox).
        """
        by_principal: dict[str, set[str]] = {}
        for item in items:
            by_principal.setdefault(item.principal, set()).add(item.envelope.message_id)
        known: dict[tuple[str, str], Mapping[str, Any]] = {}
        for principal, ids in by_principal.items():
            for chunk, marks in in_lists(list(ids)):
                rows = c.execute(
                    "SELECT i.principal, i.message_id, i.fingerprint, i.task_id, i.received_at,"
                    " t.state, t.deadline FROM inbox i JOIN tasks t ON t.task_id = i.task_id"
                    f" WHERE i.principal = ? AND i.message_id IN ({marks})",
                    [principal, *chunk],
                ).fetchall()
                for row in rows:
                    known[(row["principal"], row["message_id"])] = row
        return known

    @staticmethod
    def _parent_hops(c: sqlite3.Connection, items: Sequence[AcceptItem]) -> dict[str, int]:
        """The hops of every task named as a parent in the batch, in a few queries."""
        parents = list({i.envelope.parent_id for i in items} - {None})
        hops: dict[str, int] = {}
        for chunk, marks in in_lists(parents):
            rows = c.execute(f"SELECT task_id, hops FROM tasks WHERE task_id IN ({marks})", chunk)
            hops.update((row[0], int(row[1])) for row in rows)
        return hops

    def _accept_one(
        self,
        batch: _AcceptBatch,
        item: AcceptItem,
        now: float,
        fingerprint: str,
        payload: str,
    ) -> AcceptResult:
        """Decide one item's outcome and queue its writes on ``batch`` (written in order)."""
        env = item.envelope
        if env.kind != "task":
            detail = f"kind {env.kind!r} does not become work"
            refusal = EnvelopeError("kind", "not_task", detail)
            return AcceptResult(Outcome.NOT_TASK, detail=detail, refusal=refusal)
        key = (item.principal, env.message_id)
        row = batch.known.get(key)
        if row is not None and not self._forgotten(row, now):
            return self._known(batch, item, row, fingerprint, now)
        latest = now + self.policy.retention_s
        if env.deadline > latest:
            # Refused before anything is written: stored, it would outlive the inbox record
            # that makes a replay of the same bytes a duplicate; and the sender can correct
            # the deadline and resend under the same message id.
            detail = (
                f"deadline {env.deadline!r} is more than the retention window"
                f" ({self.policy.retention_s:g} s) ahead of now ({now!r})"
            )
            refusal = EnvelopeError("deadline", "too_large", detail)
            return AcceptResult(Outcome.REFUSED, detail=detail, refusal=refusal)
        task_id = next(batch.ids)
        hops = _hops(env, batch.parent_hops)
        state = TaskState.PENDING
        outcome = Outcome.STORED
        error = None
        if env.deadline <= now:
            state, outcome, error = TaskState.EXPIRED, Outcome.EXPIRED, "deadline already past"
        elif hops > self.policy.max_hops:
            state, outcome = TaskState.HOP_LIMIT, Outcome.HOP_LIMIT
            error = f"hops {hops} exceed the limit {self.policy.max_hops}"
        batch.tasks.append(
            (
                task_id, item.principal, env.message_id, env.kind, payload,
                fingerprint, env.correlation_id, env.parent_id, state.value, env.max_attempts,
                now, env.deadline, hops, now, now,
                None if state is TaskState.PENDING else now, error,
            )
        )  # fmt: skip
        batch.inbox.append(
            (item.principal, env.message_id, fingerprint, task_id, item.entry_id, now)
        )
        batch.known[key] = {
            "fingerprint": fingerprint, "task_id": task_id, "received_at": now,
            "state": state.value, "deadline": env.deadline,
        }  # fmt: skip
        reply_id = None
        if state is not TaskState.PENDING:
            reply_id = reply_id_for(task_id)
            t = {"principal": item.principal, "message_id": env.message_id,
                 "correlation_id": env.correlation_id, "attempts": 0, "fence": 0}  # fmt: skip
            batch.then.append(
                lambda c: self._terminal_reply(c, task_id, state, None, error, now, t=t)
            )
        return AcceptResult(outcome, task_id, reply_id, error or "")

    def _forgotten(self, row: Mapping[str, Any], now: float) -> bool:
        """Whether an inbox record no longer dedupes: past the retention window, its task
        terminal and its deadline passed (``purge`` may delete exactly these records). The
        deadline matters for records accepted before deadlines were bounded by the window:
        until it passes, a replay of that request could still run."""
        return (
            now - row["received_at"] >= self.policy.retention_s
            and row["state"] in TERMINAL_STATES
            and row["deadline"] <= now
        )

    def _known(
        self,
        batch: _AcceptBatch,
        item: AcceptItem,
        row: Mapping[str, Any],
        fingerprint: str,
        now: float,
    ) -> AcceptResult:
        env = item.envelope
        key = (item.principal, env.message_id)
        if row["fingerprint"] == fingerprint:
            batch.duplicates.append(key)
            return AcceptResult(Outcome.DUPLICATE, row["task_id"])
        reply_id = self.conflict_reply_id(item.principal, env.message_id, fingerprint)
        detail = "message_id reused with different content; the first request stands"
        body = {
            "v": 1,
            "reply_id": reply_id,
            "task_id": row["task_id"],
            "principal": item.principal,
            "message_id": env.message_id,
            "correlation_id": env.correlation_id,
            "status": "conflict",
            "result": None,
            "error": detail,
            "fingerprint": fingerprint,
            "stored_fingerprint": row["fingerprint"],
        }

        def write(c: sqlite3.Connection) -> None:
            c.execute(
                "UPDATE inbox SET conflicts = conflicts + 1 WHERE principal = ? AND message_id = ?",
                key,
            )
            enqueue(
                c, reply_id=reply_id, task_id=None, principal=item.principal,
                message_id=env.message_id, status="conflict", body=body, now=now,
            )  # fmt: skip

        batch.then.append(write)
        return AcceptResult(Outcome.CONFLICT, row["task_id"], reply_id, detail)

    def _terminal_reply(
        self,
        c: sqlite3.Connection,
        task_id: str,
        state: TaskState,
        result: str | None,
        error: str | None,
        now: float,
        t: sqlite3.Row | Mapping[str, Any] | None = None,
        encoded: tuple[bytes, str] | None = None,
        claim: PublisherClaim | None = None,
    ) -> str:
        if t is None:
            t = c.execute(
                "SELECT principal, message_id, correlation_id, attempts, fence FROM tasks"
                " WHERE task_id = ?",
                (task_id,),
            ).fetchone()
        reply_id = reply_id_for(task_id)
        if encoded is None:
            encoded = encode_body(
                _reply_body(task_id, state, t["principal"], t["message_id"],
                            t["correlation_id"], result, error, t["attempts"], t["fence"], now)
            )  # fmt: skip
        data, content_hash = encoded
        inserted = enqueue_encoded(
            c, reply_id=reply_id, task_id=task_id, principal=t["principal"],
            message_id=t["message_id"], status=state.value, data=data,
            content_hash=content_hash, now=now, claim=claim,
        )  # fmt: skip
        if not inserted:  # the unique index makes this unreachable unless a bug re-terminates
            raise StaleError(task_id, "already_terminal", "a terminal reply already exists")
        return reply_id

    def _to_terminal(
        self,
        c: sqlite3.Connection,
        task_id: str,
        state: TaskState,
        now: float,
        *,
        result: str | None = None,
        error: str | None = None,
        row: sqlite3.Row | Mapping[str, Any] | None = None,
        encoded: tuple[bytes, str] | None = None,
        claim: PublisherClaim | None = None,
    ) -> str:
        """Make a task terminal and write its reply. ``row``: the task's ``principal``,
        ``message_id``, ``correlation_id``, ``attempts`` and ``fence`` if already read in
        this transaction (``_holder`` reads them), to spare a lookup; ``encoded``: the
        reply body from ``encode_body``, if built before the transaction from them;
        ``claim``: write the reply already claimed by that publisher (see
        ``enqueue_encoded``)."""
        c.execute(
            "UPDATE tasks SET state = ?, owner = NULL, lease_until = NULL, updated_at = ?,"
            " finished_at = ?, result = ?, error = ? WHERE task_id = ?",
            (state.value, now, now, result, error, task_id),
        )
        return self._terminal_reply(c, task_id, state, result, error, now, row, encoded, claim)

    # -- workers --------------------------------------------------------------------------

    def claim(self, owner: str, n: int = 1) -> list[ClaimedTask]:
        """Hand up to ``n`` ready tasks to ``owner``: lease, attempts+1, fence+1.

        Expired leases and deadlines are reconciled first, in the same transaction.
        """
        if n < 1:
            return []
        now = self.clock.now()
        with self.db.write("claim") as c:
            rows = self._claim_in(c, owner, n, now)
        self._log_reconciled()
        return self._claimed(rows, owner, now)

    def _claim_in(self, c: sqlite3.Connection, owner: str, n: int, now: float) -> list[sqlite3.Row]:
        """``claim``'s writes inside the caller's transaction; rows in claim order."""
        self._reconcile(c, now)
        ids = [
            r[0]
            for r in c.execute(
                "SELECT task_id FROM tasks INDEXED BY tasks_ready"
                " WHERE state = 'pending' AND not_before <= ? ORDER BY not_before LIMIT ?",
                (now, n),
            )
        ]
        if not ids:
            return []
        # One statement for the whole batch; RETURNING order is unspecified, so the rows are
        # put back in claim order (oldest not_before first). ``+state`` keeps the planner on
        # the primary key whatever index on ``state`` a database may carry.
        rows = c.execute(
            "UPDATE tasks SET state = 'running', owner = ?, lease_until = ?,"
            " attempts = attempts + 1, fence = fence + 1, updated_at = ?"
            f" WHERE task_id IN ({', '.join('?' * len(ids))}) AND +state = 'pending'"
            " RETURNING task_id, principal, message_id, kind, payload, attempts,"
            " max_attempts, fence, deadline, hops, correlation_id, parent_id",
            (owner, now + self.policy.lease_s, now, *ids),
        ).fetchall()
        by_id = {r["task_id"]: r for r in rows}
        return [by_id[i] for i in ids if i in by_id]

    def handed(self, owner: str, handles: Sequence[tuple[str, int]]) -> list[ClaimedTask]:
        """The tasks ``accept_and_claim`` claimed for ``owner``, as its own ``claim`` would
        have returned them; a read (no write lock). A handle whose task moved on since
        (its lease expired and another worker claimed it: another fence) is left out.
        """
        if not handles:
            return []
        fences = dict(handles)
        by_id: dict[str, sqlite3.Row] = {}
        with self.db.read() as c:
            for chunk, marks in in_lists(list(fences)):
                for r in c.execute(
                    "SELECT task_id, principal, message_id, kind, payload, attempts,"
                    " max_attempts, fence, deadline, hops, correlation_id, parent_id,"
                    f" lease_until FROM tasks WHERE task_id IN ({marks}) AND state = 'running'"
                    " AND owner = ?",
                    (*chunk, owner),
                ):
                    if fences[r["task_id"]] == r["fence"]:
                        by_id[r["task_id"]] = r
        return [
            self._claimed_task(by_id[task_id], owner, float(by_id[task_id]["lease_until"]))
            for task_id, _ in handles
            if task_id in by_id
        ]

    def _claimed(self, rows: list[sqlite3.Row], owner: str, now: float) -> list[ClaimedTask]:
        """The claims of ``_claim_in``'s rows (built after COMMIT: decoding payloads need not
        hold the write lock)."""
        lease_until = now + self.policy.lease_s
        return [self._claimed_task(r, owner, lease_until) for r in rows]

    @staticmethod
    def _claimed_task(r: sqlite3.Row, owner: str, lease_until: float) -> ClaimedTask:
        return ClaimedTask(
            task_id=r["task_id"],
            principal=r["principal"],
            message_id=r["message_id"],
            kind=r["kind"],
            payload=json.loads(r["payload"]),
            attempt=r["attempts"],
            max_attempts=r["max_attempts"],
            fence=r["fence"],
            owner=owner,
            lease_until=lease_until,
            deadline=float(r["deadline"]),
            hops=r["hops"],
            correlation_id=r["correlation_id"],
            parent_id=r["parent_id"],
        )

    def _holder(self, c: sqlite3.Connection, task_id: str, owner: str, fence: int) -> sqlite3.Row:
        """Check rule 10 (``docs/RULES.md``); raise ``StaleError`` (and roll back) if any fails."""
        row: sqlite3.Row | None = c.execute(
            "SELECT state, owner, fence, lease_until, deadline, attempts, max_attempts,"
            " principal, message_id, correlation_id FROM tasks WHERE task_id = ?",
            (task_id,),
        ).fetchone()
        if row is None:
            raise UnknownTask(task_id)
        refusal = self._refusal(row, task_id, owner, fence)
        if refusal is not None:
            raise refusal
        return row

    def _refusal(
        self, row: sqlite3.Row, task_id: str, owner: str, fence: int, *, deadline: bool = True
    ) -> StaleError | None:
        """Rule 10 on one task row: why ``owner`` under ``fence`` may not act on it (fence,
        cancelled, not running, owner, lease, and with ``deadline`` the deadline), or None."""
        now = self.clock.now()
        if row["fence"] != fence:
            return FencedError(task_id, fence, row["fence"])
        if row["state"] == TaskState.CANCELLED:
            return TaskCancelled(task_id)
        if row["state"] != TaskState.RUNNING:
            return StaleError(task_id, "not_running", f"state is {row['state']}")
        if row["owner"] != owner:
            return StaleError(task_id, "owner", f"held by {row['owner']}")
        if row["lease_until"] <= now:
            return StaleError(task_id, "lease_expired")
        if deadline and row["deadline"] <= now:
            return StaleError(task_id, "deadline")
        return None

    def renew(self, task_id: str, owner: str, fence: int) -> float:
        """Extend the lease by ``policy.lease_s``.

        Returns:
            the new ``lease_until``.

        Raises:
            TaskCancelled: the task was cancelled; stop work.
            StaleError: the lease is lost (fence, owner, expiry, deadline).
        """
        now = self.clock.now()
        lease_until = now + self.policy.lease_s
        with self.db.write("renew") as c:
            self._holder(c, task_id, owner, fence)
            c.execute(
                "UPDATE tasks SET lease_until = ?, updated_at = ? WHERE task_id = ? AND fence = ?",
                (lease_until, now, task_id, fence),
            )
        return lease_until

    def finish(self, task_id: str, owner: str, fence: int, result: Any) -> str:
        """Commit success: state ``done`` and its reply, in one transaction (fenced).

        Args:
            result: any JSON value within the result bounds (``envelope.check_result``);
                stored canonically and carried in the reply.

        Returns:
            the reply id.

        Raises:
            StaleError: refused; nothing is written.
            ValueError: ``result`` is not JSON (NaN, a set, ...), or an ``EnvelopeError``
                for a result over the bounds; nothing is written.
        """
        encoded = check_result(result).decode("utf-8")
        now = self.clock.now()
        with self.db.write("finish") as c:
            return self._finish_in(c, task_id, owner, fence, encoded, now)

    def fail(
        self, task_id: str, owner: str, fence: int, error: str, *, retryable: bool
    ) -> FailOutcome:
        """Record a failed attempt (fenced).

        A retryable failure with attempts left, and time left before the deadline after the
        backoff, goes back to ``pending``; anything else ends ``failed`` with its reply.

        Raises:
            StaleError: refused; nothing is written.
        """
        now = self.clock.now()
        with self.db.write("fail") as c:
            return self._fail_in(c, task_id, owner, fence, error, retryable, now)

    def settle_many(self, items: Sequence[Settlement]) -> list[SettleResult]:
        """``settle_and_claim`` without the claim."""
        return self.settle_and_claim(items, "", 0)[0]

    def settle_and_claim(
        self, items: Sequence[Settlement], owner: str, n: int
    ) -> tuple[list[SettleResult], list[ClaimedTask]]:
        """Commit a batch of outcomes (each fenced like ``finish`` / ``fail``) and claim the
        next batch (like ``claim(owner, n)``; nothing when ``n`` is 0) in ONE transaction:
        one fsync for both instead of one per task and one per claim.

        An item the store refuses (stale fence, lost lease, cancelled, deadline) is refused
        at its holder check, before it writes anything, and reported; the others commit
        together. Crash points are ``store.finish.before_commit`` and
        ``store.finish.after_commit``, once per batch.

        Args:
            items: the outcomes, in the order the handlers ended.
            owner: who claims the next batch.
            n: how many tasks to claim at most.

        Returns:
            one entry per item, in order: the reply id (done), a ``FailOutcome`` (failed or
            back to pending), or the ``StaleError`` that refused it; and the claimed tasks.

        Raises:
            StoreBusy, StoreError: the transaction as a whole failed; nothing was written.
        """
        batch = self.settle_batch(items, owner, n)
        return batch.results, batch.claimed

    def settle_batch(
        self,
        items: Sequence[Settlement],
        owner: str,
        n: int,
        *,
        publish_as: str | None = None,
        publish_lease_s: float = 30.0,
        sent: Sequence[SentMark] = (),
    ) -> SettledBatch:
        """``settle_and_claim``, and for a worker that publishes its own replies: the
        terminal replies are written already claimed by publisher ``publish_as`` (what
        ``OutboxStore.claim`` would set: ``sending``, owner, lease of ``publish_lease_s``,
        attempts+1, fence+1), and ``sent``, confirmed publications of that publisher's
        earlier replies, are marked sent (each fenced) in the same transaction.

        Args:
            items, owner, n: as for ``settle_and_claim``.
            publish_as: the publisher identity; ``None`` leaves replies ``pending`` for the
                dispatcher.
            publish_lease_s: the publisher's lease on the replies written now.
            sent: ``(reply_id, fence, entry_id, sent_at)`` of replies ``publish_as``
                published; needs ``publish_as``.

        Raises:
            ValueError: ``sent`` without ``publish_as``.
            StoreBusy, StoreError: the transaction as a whole failed; nothing was written.
        """
        if sent and publish_as is None:
            raise ValueError("sent marks need the publisher (publish_as) that holds them")
        out: list[SettleResult] = []
        if not items and n < 1 and not sent:
            return SettledBatch(out, [])
        now = self.clock.now()
        # Replies of successes are encoded and hashed before the transaction (from what the
        # claim returned), so the write lock is held for the SQL only. Inside, each one is
        # used only if the row still says the same (it does whenever the fence matches).
        bodies = [_done_reply(item, now) for item in items]
        claim = None if publish_as is None else PublisherClaim(publish_as, now + publish_lease_s)
        marks: list[StaleError | None] = []
        with self.db.write("finish") as c:
            if sent:
                assert publish_as is not None
                marks = mark_sent_in(c, publish_as, sent, self.clock.now())
            for item, body in zip(items, bodies, strict=True):
                # A refusal (StaleError) comes from the holder check, before this item wrote
                # anything; an error after its first write aborts the whole transaction.
                if item.result is not None:
                    row = self._finish_check(c, item, now, out)
                    if row is not None:
                        out.append(self._finish_reply(c, item, row, body, now, claim))
                    continue
                try:
                    row = self._holder(c, item.task_id, item.owner, item.fence)
                except StaleError as exc:
                    out.append(exc)
                    continue
                error = item.error or ""
                out.append(self._fail_row(c, row, item.task_id, error, item.retryable, now, claim))
            rows = self._claim_in(c, owner, n, now) if n >= 1 else []
        if n >= 1:
            self._log_reconciled()
        replies = [] if claim is None else claim.rows
        return SettledBatch(out, self._claimed(rows, owner, now), replies, marks)

    def _finish_check(
        self, c: sqlite3.Connection, item: Settlement, now: float, out: list[SettleResult]
    ) -> sqlite3.Row | None:
        """Mark one item ``done`` inside ``settle_and_claim``: the holder check (rule 10) is
        the WHERE clause of the state change itself, one statement instead of two. When it
        matches nothing, nothing was written and ``_holder``'s precise refusal is appended
        to ``out``; returns the row the reply is built from otherwise."""
        check_at = self.clock.now()
        row: sqlite3.Row | None = c.execute(
            "UPDATE tasks SET state = 'done', owner = NULL, lease_until = NULL, updated_at = ?,"
            " finished_at = ?, result = ?, error = NULL WHERE task_id = ? AND fence = ?"
            " AND state = 'running' AND owner = ? AND lease_until > ? AND deadline > ?"
            " RETURNING principal, message_id, correlation_id, attempts, fence",
            (now, now, item.result, item.task_id, item.fence, item.owner, check_at, check_at),
        ).fetchone()
        if row is None:
            try:
                self._holder(c, item.task_id, item.owner, item.fence)
                out.append(StaleError(item.task_id, "lease_expired"))  # the clock moved on
            except StaleError as exc:
                out.append(exc)
        return row

    def _finish_reply(
        self,
        c: sqlite3.Connection,
        item: Settlement,
        row: sqlite3.Row,
        body: tuple[_ReplyKey, tuple[bytes, str]] | None,
        now: float,
        claim: PublisherClaim | None = None,
    ) -> str:
        """The reply of an item ``_finish_check`` marked done (same transaction)."""
        encoded = body[1] if body is not None and body[0] == _reply_key(row) else None
        try:
            return self._terminal_reply(
                c, item.task_id, TaskState.DONE, item.result, None, now, row, encoded, claim
            )
        except StaleError as exc:  # a second terminal reply: a bug, never a refusal
            raise BrokerAdapterError(f"task {item.task_id} was finished twice: {exc}") from exc

    def _finish_in(
        self, c: sqlite3.Connection, task_id: str, owner: str, fence: int, encoded: str,
        now: float,
    ) -> str:  # fmt: skip
        row = self._holder(c, task_id, owner, fence)
        return self._to_terminal(c, task_id, TaskState.DONE, now, result=encoded, row=row)

    def _fail_in(
        self, c: sqlite3.Connection, task_id: str, owner: str, fence: int, error: str,
        retryable: bool, now: float,
    ) -> FailOutcome:  # fmt: skip
        row = self._holder(c, task_id, owner, fence)
        return self._fail_row(c, row, task_id, error, retryable, now)

    def _fail_row(
        self, c: sqlite3.Connection, row: sqlite3.Row, task_id: str, error: str,
        retryable: bool, now: float, claim: PublisherClaim | None = None,
    ) -> FailOutcome:  # fmt: skip
        if retryable and row["attempts"] < row["max_attempts"]:
            not_before = now + self.policy.backoff.delay(row["attempts"], self.rng)
            if not_before < row["deadline"]:
                c.execute(
                    "UPDATE tasks SET state = 'pending', owner = NULL, lease_until = NULL,"
                    " not_before = ?, error = ?, updated_at = ? WHERE task_id = ?",
                    (not_before, error, now, task_id),
                )
                return FailOutcome.RETRY
            error = f"{error} (no retry: the deadline comes first)"
        elif retryable:
            error = f"{error} (attempts exhausted: {row['attempts']}/{row['max_attempts']})"
        self._to_terminal(c, task_id, TaskState.FAILED, now, error=error, row=row, claim=claim)
        return FailOutcome.FAILED

    def has_work(self) -> bool:
        """Whether a claim would find something now: a ready pending task or an expired
        lease. A read (no write lock, no fsync): idle workers ask this before claiming."""
        now = self.clock.now()
        row = self.db.fetch_one(
            "SELECT EXISTS (SELECT 1 FROM tasks INDEXED BY tasks_ready"
            " WHERE state = 'pending' AND not_before <= ?)"
            " OR EXISTS (SELECT 1 FROM tasks INDEXED BY tasks_leases"
            " WHERE state = 'running' AND lease_until <= ?)",
            (now, now),
        )
        return row is not None and bool(row[0])

    def cancel(self, task_id: str, reason: str = "cancelled") -> TaskState:
        """Cancel a live task durably (with its reply). A running handler is fenced out:
        its renew and commit are refused from now on. An effect it already caused stays.

        Returns:
            the task's state afterwards (unchanged if it was already terminal).

        Raises:
            UnknownTask: no such task.
        """
        now = self.clock.now()
        with self.db.write("cancel") as c:
            row = c.execute("SELECT state FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
            if row is None:
                raise UnknownTask(task_id)
            state = TaskState(row["state"])
            if state in TERMINAL_STATES:
                return state
            self._to_terminal(c, task_id, TaskState.CANCELLED, now, error=reason)
        transitions.task_transition("cancelled", task_id, "cancelled", detail=reason,
                                    reply_id=reply_id_for(task_id))  # fmt: skip
        return TaskState.CANCELLED

    def refusal(self, task_id: str, owner: str, fence: int) -> StaleError | None:
        """Whether ``owner`` still holds ``task_id`` under ``fence``: rule 10's check as one
        read statement (no transaction), the deadline left to the caller. Returns the
        refusal (``TaskCancelled``, ``FencedError``, or a ``StaleError`` saying why the
        claim is gone), or None while it holds. A worker asks it before a handler starts
        and whenever the handler asks ``Task.cancelled()``."""
        row = self.db.fetch_one(
            "SELECT state, owner, fence, lease_until, deadline FROM tasks WHERE task_id = ?",
            (task_id,),
        )
        if row is None:
            return StaleError(task_id, "not_running", "no such task")
        return self._refusal(row, task_id, owner, fence, deadline=False)

    def is_cancelled(self, task_id: str) -> bool:
        row = self.db.fetch_one("SELECT state FROM tasks WHERE task_id = ?", (task_id,))
        return row is not None and row[0] == TaskState.CANCELLED

    # -- housekeeping ---------------------------------------------------------------------

    def reconcile(self) -> dict[str, int]:
        """Apply the clock: expire deadlines, take back expired leases.

        Returns:
            counts by what happened: ``expired``, ``requeued``, ``exhausted``.
        """
        with self.db.write("reconcile") as c:
            counts = self._reconcile(c, self.clock.now())
        self._log_reconciled()
        return counts

    def _log_reconciled(self) -> None:
        taken, self._reconciled = self._reconciled, []
        transitions.reconciled(taken)

    def _reconcile(self, c: sqlite3.Connection, now: float) -> dict[str, int]:
        counts = {"expired": 0, "requeued": 0, "exhausted": 0}
        self._reconciled = taken = []  # logged once the caller's transaction commits
        for (task_id,) in c.execute(
            "SELECT task_id FROM tasks INDEXED BY tasks_live_deadline"
            " WHERE state IN ('pending', 'running') AND deadline <= ?",
            (now,),
        ).fetchall():
            self._to_terminal(c, task_id, TaskState.EXPIRED, now, error="deadline reached")
            counts["expired"] += 1
            taken.append((task_id, "expired", "expired", None, None))
        for r in c.execute(
            "SELECT task_id, attempts, max_attempts, owner FROM tasks INDEXED BY tasks_leases"
            " WHERE state = 'running' AND lease_until <= ?",
            (now,),
        ).fetchall():
            if r["attempts"] >= r["max_attempts"]:
                self._to_terminal(
                    c,
                    r["task_id"],
                    TaskState.FAILED,
                    now,
                    error=f"lease of {r['owner']} expired on the last attempt "
                    f"({r['attempts']}/{r['max_attempts']})",
                )
                counts["exhausted"] += 1
                taken.append((r["task_id"], "failed", "failed", r["owner"], r["attempts"]))
            else:
                c.execute(
                    "UPDATE tasks SET state = 'pending', owner = NULL, lease_until = NULL,"
                    " not_before = ?, error = ?, updated_at = ? WHERE task_id = ?",
                    (now, f"lease of {r['owner']} expired", now, r["task_id"]),
                )
                counts["requeued"] += 1
                taken.append((r["task_id"], "lease_expired", "pending", r["owner"], r["attempts"]))
        self.lease_takeovers += counts["requeued"] + counts["exhausted"]
        return counts

    def purge_batch(self, after: int = 0, limit: int = PURGE_BATCH) -> PurgeBatch:
        """Forget at most ``limit`` requests past the retention window, with everything
        kept for them (task, inbox record, reply), in one short transaction; see
        ``retention`` for the rule and ``PurgeBatch.after`` / ``more`` for the pass."""
        return purge_requests(self.db, self.clock.now(), self.policy.retention_s, after, limit)

    def purge(self, limit: int = PURGE_BATCH) -> int:
        """A whole purge pass, batch after batch (no pause: the runner's purger spaces its
        batches with ``PurgeSchedule``). Returns how many requests were forgotten."""
        return whole_pass(lambda after: self.purge_batch(after, limit)).requests

    # -- reads ----------------------------------------------------------------------------

    def get(self, task_id: str) -> TaskRow | None:
        with self.db.read() as c:
            row = c.execute(
                f"SELECT {_TASK_COLUMNS} FROM tasks WHERE task_id = ?", (task_id,)
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

    def open_counts(self) -> dict[str, int]:
        """Tasks not yet terminal (pending or running) per principal, for the ingest's
        quota (``limits``): one pass over the live tasks' partial index."""
        with self.db.read() as c:
            rows = c.execute(
                "SELECT principal, count(*) FROM tasks INDEXED BY tasks_live_deadline"
                " WHERE state IN ('pending', 'running') GROUP BY principal"
            ).fetchall()
        return {r[0]: r[1] for r in rows}

    def counts(self) -> dict[str, int]:
        with self.db.read() as c:
            rows = c.execute("SELECT state, count(*) FROM tasks GROUP BY state").fetchall()
        out = {s.value: 0 for s in TaskState}
        out.update({r[0]: r[1] for r in rows})
        return out


def _reply_body(
    task_id: str, state: TaskState, principal: str, message_id: str,
    correlation_id: str | None, result: str | None, error: str | None, attempts: int,
    fence: int, now: float,
) -> dict[str, Any]:  # fmt: skip
    """A terminal reply's body (``result`` is the stored canonical JSON text)."""
    return {
        "v": 1,
        "reply_id": reply_id_for(task_id),
        "task_id": task_id,
        "principal": principal,
        "message_id": message_id,
        "correlation_id": correlation_id,
        "status": state.value,
        "result": None if result is None else json.loads(result),
        "error": error,
        "attempts": attempts,
        "fence": fence,
        "finished_at": now,
    }


_ReplyKey = tuple[str, str, str | None, int, int]


def _reply_key(row: sqlite3.Row | Mapping[str, Any]) -> _ReplyKey:
    """What a reply body takes from the task row besides the outcome."""
    return (row["principal"], row["message_id"], row["correlation_id"], row["attempts"],
            row["fence"])  # fmt: skip


def _done_reply(item: Settlement, now: float) -> tuple[_ReplyKey, tuple[bytes, str]] | None:
    """The encoded ``done`` reply of ``item``, built from its claim, or ``None``."""
    claimed = item.claimed
    if item.result is None or claimed is None:
        return None
    key = (claimed.principal, claimed.message_id, claimed.correlation_id, claimed.attempt,
           claimed.fence)  # fmt: skip
    body = _reply_body(claimed.task_id, TaskState.DONE, *key[:3], item.result, None, *key[3:], now)
    return key, encode_body(body)
