"""The inbox: each authenticated request recorded once, as a task or as its answer.

``accept`` records a batch of envelopes in one transaction. A request is identified by
``(principal, message_id)``: the same identity with the same content (fingerprint) is a
duplicate of the stored task; with other content a conflict, answered under a stable
conflict reply id (``conflict_reply_id``) while the stored request stands. A deadline
already past, too many hops (``docs/RULES.md`` rule 12, counted by ``hops``) or a spent
chain budget (``TaskPolicy.max_chain_tasks`` tasks stored by the principal under the
request's ``correlation_id``, table ``chains``) store the task terminal at once (``hop_limit`` for
both), with its reply. ``accept_and_claim`` also claims new tasks for idle
workers in the same transaction (the hand-off).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

from broker_adapter.errors import EnvelopeError
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.reply import CONFLICT_STATUS, conflict_body, reply_id_for
from broker_adapter.store import transitions
from broker_adapter.store.dbclock import tx_now
from broker_adapter.store.lifecycle import write_reply
from broker_adapter.store.outbox_writes import enqueue
from broker_adapter.store.sql import Conn, in_lists
from broker_adapter.store.task_tx import TaskTx
from broker_adapter.store.task_types import TERMINAL_STATES, TaskPolicy, TaskState


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


class AcceptItem(NamedTuple):
    """One authenticated envelope. ``principal`` must come from a verified check; ``kid``
    is the key id its signature verified with (its reply is signed with the same key)."""

    principal: str
    envelope: Envelope
    entry_id: str | None = None
    kid: str | None = None


class AcceptResult(NamedTuple):
    """What ``accept`` did with one item (a tuple: one is made per stream entry).

    ``refusal`` is set for ``NOT_TASK`` and ``REFUSED``: the envelope rule it breaks, with
    the field and reason its dead letter carries."""

    outcome: Outcome
    task_id: str | None = None
    reply_id: str | None = None
    detail: str = ""
    refusal: EnvelopeError | None = None


class Intake(NamedTuple):
    """What ``TaskStore.accept_and_claim`` did: the accept results, in item order, and per
    owner asked for the ``(task_id, fence)`` handles claimed for it."""

    results: list[AcceptResult]
    claimed: list[list[tuple[str, int]]]


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
    " created_at, updated_at, finished_at, error, traceparent, task_name, request_kid)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
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
    #: Tasks stored per ``correlation_id`` named in the batch (the chain budget), counting
    #: those this batch stores; ``chain_adds`` is what this batch adds.
    chains: dict[str, int]
    #: Fresh task ids, one per item of the batch at most (drawn in one go).
    ids: Iterator[str]
    #: The database's key of conflict reply ids (``conflict_reply_id``).
    conflict_key: bytes
    tasks: list[tuple[Any, ...]] = field(default_factory=list)
    inbox: list[tuple[Any, ...]] = field(default_factory=list)
    duplicates: list[tuple[str, str]] = field(default_factory=list)
    then: list[Callable[[Conn], object]] = field(default_factory=list)
    chain_adds: dict[str, int] = field(default_factory=dict)
    now: float = 0.0

    def write(self, c: Conn) -> None:
        if self.tasks:
            c.executemany(_INSERT_TASK, self.tasks)
            c.executemany(_UPSERT_INBOX, self.inbox)
        if self.chain_adds:
            c.executemany(
                "INSERT INTO chains (chain_id, tasks, updated_at) VALUES (?, ?, ?)"
                " ON CONFLICT (chain_id) DO UPDATE SET tasks = chains.tasks + excluded.tasks,"
                " updated_at = excluded.updated_at",
                [(cid, n, self.now) for cid, n in sorted(self.chain_adds.items())],
            )
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


def accept_and_claim(
    tx: TaskTx,
    conflict_key: bytes,
    items: Sequence[AcceptItem],
    claim_for: Sequence[tuple[str, int]],
) -> Intake:
    """``TaskStore.accept``, and in the same transaction a ``claim`` of up to ``n`` ready tasks
    for each ``(owner, n)`` of ``claim_for``, in that order: the ingest hands new tasks
    to idle workers without a claim transaction of theirs (``handoff.Handoff``). The
    claims are the very claims ``claim`` makes (reconcile first, oldest ready first,
    lease, attempts+1, fence+1: ``tx.claim_in``); each owner takes them up with
    ``handed``. ``conflict_key`` is the database's key of conflict reply ids
    (``conflict_reply_id``).

    Returns:
        the ``accept`` results, and per owner of ``claim_for`` the ``(task_id, fence)``
        handles it claimed (possibly none).
    """
    if not items:
        return Intake([], [[] for _ in claim_for])
    # Hash and encode before taking the write lock: the transaction holds it for SQL only.
    fingerprints = [item.envelope.fingerprint() for item in items]
    payloads = [item.envelope.payload_json() for item in items]
    ids = new_task_ids(len(items))
    with tx.db.write("accept") as c:
        now = tx_now(c, tx.clock)  # the server's on PostgreSQL (``dbclock``)
        results = accept_in(tx.policy, conflict_key, c, items, now, fingerprints, payloads, ids)
        stored = any(r.outcome is Outcome.STORED for r in results)
        claimed = [
            [(r["task_id"], r["fence"]) for r in tx.claim_in(c, owner, n, now)]
            if stored and n >= 1
            else []
            for owner, n in claim_for
        ]
    tx.log_reconciled()
    transitions.accepted(items, results)
    return Intake(results, claimed)


def accept_in(
    policy: TaskPolicy,
    conflict_key: bytes,
    c: Conn,
    items: Sequence[AcceptItem],
    now: float,
    fingerprints: Sequence[str],
    payloads: Sequence[str],
    ids: Sequence[str],
) -> list[AcceptResult]:
    """Read the batch's inbox records, decide every item (by ``policy``'s limits) and
    write the decisions, in the caller's transaction.

    Where several processes write the database at once (PostgreSQL), two transactions
    could both find no record for one identity and both store a task. So where the
    dialect has a ``key_lock``, the transaction first takes one per identity of the batch
    (``identity_lock``) and per chain it names (``chain_lock``: two hosts never both spend a
    chain's last task), in one sorted order (two batches never wait on each other in a
    cycle): a second accept of the same identity waits for the first to commit, then reads
    its record and answers ``duplicate`` or ``conflict``, as SQLite's one writer does. The
    inbox's primary key stays the last word: an insert it refuses aborts the transaction,
    never a second record.
    """
    if c.dialect.key_lock is not None:
        chains = {chain_of(i) for i in items} - {None}
        keys = sorted(
            {identity_lock(i.principal, i.envelope.message_id) for i in items}
            | {chain_lock(cid) for cid in chains if cid is not None}
        )
        c.executemany(c.dialect.key_lock, [(k,) for k in keys])
    batch = _AcceptBatch(
        known=_prefetch(c, items),
        parent_hops=_parent_hops(c, items),
        chains=_chain_counts(c, items),
        ids=iter(ids),
        conflict_key=conflict_key,
        now=now,
    )
    results = [
        _accept_one(policy, batch, item, now, fingerprint, payload)
        for item, fingerprint, payload in zip(items, fingerprints, payloads, strict=True)
    ]
    batch.write(c)
    return results


def identity_lock(principal: str, message_id: str) -> int:
    """The lock key of one request identity: 64 bits of its SHA-256, signed (a collision
    only makes two identities wait on each other)."""
    digest = hashlib.sha256(f"{principal}\0{message_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def chain_of(item: AcceptItem) -> str | None:
    """The chain budget ``item`` spends: its ``correlation_id`` counted per principal (the
    principal's name holds no ``:``), so that another principal naming the same
    ``correlation_id`` spends a budget of its own; ``None`` without one."""
    cid = item.envelope.correlation_id
    return None if cid is None else f"{item.principal}:{cid}"


def chain_lock(chain_id: str) -> int:
    """The lock key of one chain budget (``correlation_id``)."""
    digest = hashlib.sha256(f"chain\0{chain_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _prefetch(c: Conn, items: Sequence[AcceptItem]) -> dict[tuple[str, str], Mapping[str, Any]]:
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


def _parent_hops(c: Conn, items: Sequence[AcceptItem]) -> dict[str, int]:
    """The hops of every task named as a parent in the batch, in a few queries."""
    parents = list({i.envelope.parent_id for i in items} - {None})
    hops: dict[str, int] = {}
    for chunk, marks in in_lists(parents):
        sql = f"SELECT task_id, hops FROM tasks WHERE task_id IN ({marks})"
        rows = c.execute(sql, chunk).fetchall()
        hops.update((row["task_id"], int(row["hops"])) for row in rows)
    return hops


def _chain_counts(c: Conn, items: Sequence[AcceptItem]) -> dict[str, int]:
    """The tasks stored so far in every chain the batch names (``chain_of``; none named:
    no query)."""
    named = [cid for cid in {chain_of(i) for i in items} if cid is not None]
    counts: dict[str, int] = {}
    for chunk, marks in in_lists(named):
        sql = f"SELECT chain_id, tasks FROM chains WHERE chain_id IN ({marks})"
        rows = c.execute(sql, chunk).fetchall()
        counts.update((row["chain_id"], int(row["tasks"])) for row in rows)
    return counts


def _accept_one(
    policy: TaskPolicy,
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
    if row is not None and not _forgotten(policy.retention_s, row, now):
        return _known(batch, item, row, fingerprint, now)
    latest = now + policy.retention_s
    if env.deadline > latest:
        # Refused before anything is written: stored, it would outlive the inbox record
        # that makes a replay of the same bytes a duplicate; and the sender can correct
        # the deadline and resend under the same message id.
        detail = (
            f"deadline {env.deadline!r} is more than the retention window"
            f" ({policy.retention_s:g} s) ahead of now ({now!r})"
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
    elif hops > policy.max_hops:
        state, outcome = TaskState.HOP_LIMIT, Outcome.HOP_LIMIT
        error = f"hops {hops} exceed the limit {policy.max_hops}"
    elif (chain := chain_of(item)) is not None:
        # The chain budget: counted by the system per principal and correlation_id, so a
        # request that leaves out its parent_id (its hops start again) still spends its
        # chain's budget, and nobody else's naming of the correlation_id spends it.
        stored = batch.chains.get(chain, 0)
        if stored >= policy.max_chain_tasks:
            state, outcome = TaskState.HOP_LIMIT, Outcome.HOP_LIMIT
            error = (
                f"chain {env.correlation_id!r} of {item.principal} has {stored} tasks: its"
                f" budget of {policy.max_chain_tasks} is spent"
            )
        else:
            batch.chains[chain] = stored + 1
            batch.chain_adds[chain] = batch.chain_adds.get(chain, 0) + 1
    batch.tasks.append(
        (
            task_id,
            item.principal,
            env.message_id,
            env.kind,
            payload,
            fingerprint,
            env.correlation_id,
            env.parent_id,
            state.value,
            env.max_attempts,
            now,
            env.deadline,
            hops,
            now,
            now,
            None if state is TaskState.PENDING else now,
            error,
            env.traceparent,
            env.task,
            item.kid,
        )
    )
    batch.inbox.append((item.principal, env.message_id, fingerprint, task_id, item.entry_id, now))
    batch.known[key] = {
        "fingerprint": fingerprint,
        "task_id": task_id,
        "received_at": now,
        "state": state.value,
        "deadline": env.deadline,
    }
    reply_id = None
    if state is not TaskState.PENDING:
        reply_id = reply_id_for(task_id)
        t = {
            "principal": item.principal,
            "message_id": env.message_id,
            "correlation_id": env.correlation_id,
            "attempts": 0,
            "fence": 0,
            "traceparent": env.traceparent,
        }
        batch.then.append(lambda c: write_reply(c, task_id, state, None, error, now, t=t))
    return AcceptResult(outcome, task_id, reply_id, error or "")


def _forgotten(retention_s: float, row: Mapping[str, Any], now: float) -> bool:
    """Whether an inbox record no longer dedupes: past the retention window, its task
    terminal and its deadline passed (``purge`` may delete exactly these records). The
    deadline matters for records accepted before deadlines were bounded by the window:
    until it passes, a replay of that request could still run."""
    return (
        now - row["received_at"] >= retention_s
        and row["state"] in TERMINAL_STATES
        and row["deadline"] <= now
    )


def _known(
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
    reply_id = conflict_reply_id(batch.conflict_key, item.principal, env.message_id, fingerprint)
    detail = "message_id reused with different content; the first request stands"
    body = conflict_body(
        reply_id,
        row["task_id"],
        item.principal,
        env.message_id,
        env.correlation_id,
        detail,
        fingerprint,
        row["fingerprint"],
        traceparent=env.traceparent,
        answered_at=now,
    )

    def write(c: Conn) -> None:
        c.execute(
            "UPDATE inbox SET conflicts = conflicts + 1 WHERE principal = ? AND message_id = ?",
            key,
        )
        enqueue(
            c,
            reply_id=reply_id,
            task_id=None,
            principal=item.principal,
            message_id=env.message_id,
            status=CONFLICT_STATUS,
            body=body,
            now=now,
        )

    batch.then.append(write)
    return AcceptResult(Outcome.CONFLICT, row["task_id"], reply_id, detail)
