"""Intake on PostgreSQL: a batch of authenticated envelopes recorded in one transaction,
deduplicated on the inbox's primary key ``(principal, message_id)``.

The decisions are ``store.inbox``'s (stored, duplicate, conflict, expired, hop limit,
refused, not a task), made on the inbox records the batch names. With several adapter
processes on one database (a takeover of a dead host's stream entries delivers the same
envelope to another process), two transactions could both find no record for one
identity and both store a task. So before it reads those records, the transaction takes a
transaction-scoped advisory lock per identity of the batch (``identity_lock``), in one
sorted order (two batches never wait on each other in a cycle): a second accept of the
same identity waits for the first to commit, then reads its record and answers
``duplicate`` (or ``conflict``), exactly as the single SQLite writer does. The primary key
stays the last word: an insert it refuses aborts the transaction, never a second record.
The chain budget (``chains``, per ``correlation_id``) is read under a lock of the same kind
per chain the batch names (``chain_lock``, in the same sorted set), so two hosts never
both spend a chain's last task.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from broker_adapter.errors import EnvelopeError
from broker_adapter.protocol.reply import CONFLICT_STATUS, conflict_body, reply_id_for
from broker_adapter.store.inbox import AcceptItem, AcceptResult, Outcome, _forgotten, _hops
from broker_adapter.store.lifecycle import TaskState, write_reply
from broker_adapter.store.outbox import enqueue
from broker_adapter.store.postgres.db import Conn

if TYPE_CHECKING:
    from broker_adapter.store.postgres.tasks import PgTaskStore

_INSERT_TASK = (
    "INSERT INTO tasks (task_id, principal, message_id, kind, payload, fingerprint,"
    " correlation_id, parent_id, state, max_attempts, not_before, deadline, hops,"
    " created_at, updated_at, finished_at, error, traceparent)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
)
# A reused id past the retention window (its task terminal) takes the record over.
_UPSERT_INBOX = (
    "INSERT INTO inbox (principal, message_id, fingerprint, task_id, entry_id, received_at)"
    " VALUES (%s, %s, %s, %s, %s, %s)"
    " ON CONFLICT (principal, message_id) DO UPDATE SET fingerprint = excluded.fingerprint,"
    " task_id = excluded.task_id, entry_id = excluded.entry_id,"
    " received_at = excluded.received_at, duplicates = 0, conflicts = 0"
)


def chain_lock(chain_id: str) -> int:
    """The advisory-lock key of one chain budget (``correlation_id``): two hosts accepting
    tasks of one chain count it one after the other, never both under its budget."""
    digest = hashlib.sha256(f"chain\0{chain_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def identity_lock(principal: str, message_id: str) -> int:
    """The advisory-lock key of one request identity: 64 bits of its SHA-256, signed (a
    collision only makes two identities wait on each other)."""
    digest = hashlib.sha256(f"{principal}\0{message_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


@dataclass
class _AcceptBatch:
    """What one accept transaction decided, written in bulk and in order."""

    known: dict[tuple[str, str], Mapping[str, Any]]
    parent_hops: dict[str, int]
    #: Tasks stored per ``correlation_id`` named in the batch (the chain budget), counting
    #: those this batch stores; ``chain_adds`` is what this batch adds.
    chains: dict[str, int]
    ids: Iterator[str]
    tasks: list[tuple[Any, ...]] = field(default_factory=list)
    inbox: list[tuple[Any, ...]] = field(default_factory=list)
    duplicates: list[tuple[str, str]] = field(default_factory=list)
    then: list[Callable[[Conn], object]] = field(default_factory=list)
    chain_adds: dict[str, int] = field(default_factory=dict)
    now: float = 0.0

    def write(self, c: Conn) -> None:
        cur = c.cursor()
        if self.tasks:
            cur.executemany(_INSERT_TASK, self.tasks)
            cur.executemany(_UPSERT_INBOX, self.inbox)
        if self.chain_adds:
            cur.executemany(
                "INSERT INTO chains (chain_id, tasks, updated_at) VALUES (%s, %s, %s)"
                " ON CONFLICT (chain_id) DO UPDATE SET tasks = chains.tasks + excluded.tasks,"
                " updated_at = excluded.updated_at",
                [(cid, n, self.now) for cid, n in sorted(self.chain_adds.items())],
            )
        if self.duplicates:
            cur.executemany(
                "UPDATE inbox SET duplicates = duplicates + 1"
                " WHERE principal = %s AND message_id = %s",
                self.duplicates,
            )
        for op in self.then:
            op(c)


def accept_in(
    store: PgTaskStore, c: Conn, items: Sequence[AcceptItem], now: float,
    fingerprints: Sequence[str], payloads: Sequence[str], ids: Sequence[str],
) -> list[AcceptResult]:  # fmt: skip
    """Lock the batch's identities, read their records, decide and write every item."""
    chains = {i.envelope.correlation_id for i in items} - {None}
    keys = sorted({identity_lock(i.principal, i.envelope.message_id) for i in items}
                  | {chain_lock(cid) for cid in chains if cid is not None})  # fmt: skip
    c.cursor().executemany("SELECT pg_advisory_xact_lock(%s)", [(k,) for k in keys])
    batch = _AcceptBatch(known=_prefetch(c, items), parent_hops=_parent_hops(c, items),
                         chains=_chain_counts(c, chains), ids=iter(ids), now=now)  # fmt: skip
    results = [
        _accept_one(store, batch, item, now, fingerprint, payload)
        for item, fingerprint, payload in zip(items, fingerprints, payloads, strict=True)
    ]
    batch.write(c)
    return results


def _prefetch(c: Conn, items: Sequence[AcceptItem]) -> dict[tuple[str, str], Mapping[str, Any]]:
    """The inbox records of a whole batch: one primary-key query per principal."""
    by_principal: dict[str, set[str]] = {}
    for item in items:
        by_principal.setdefault(item.principal, set()).add(item.envelope.message_id)
    known: dict[tuple[str, str], Mapping[str, Any]] = {}
    for principal, ids in by_principal.items():
        rows = c.execute(
            "SELECT i.principal, i.message_id, i.fingerprint, i.task_id, i.received_at,"
            " t.state, t.deadline FROM inbox i JOIN tasks t ON t.task_id = i.task_id"
            " WHERE i.principal = %s AND i.message_id = ANY(%s)",
            (principal, list(ids)),
        ).fetchall()
        for row in rows:
            known[(row["principal"], row["message_id"])] = row
    return known


def _parent_hops(c: Conn, items: Sequence[AcceptItem]) -> dict[str, int]:
    parents = list({i.envelope.parent_id for i in items} - {None})
    if not parents:
        return {}
    rows = c.execute("SELECT task_id, hops FROM tasks WHERE task_id = ANY(%s)", (parents,))
    return {r["task_id"]: int(r["hops"]) for r in rows}


def _chain_counts(c: Conn, chains: set[str | None]) -> dict[str, int]:
    """The tasks stored so far under every ``correlation_id`` the batch names (none named:
    no query)."""
    named = [cid for cid in chains if cid is not None]
    if not named:
        return {}
    rows = c.execute("SELECT chain_id, tasks FROM chains WHERE chain_id = ANY(%s)", (named,))
    return {r["chain_id"]: int(r["tasks"]) for r in rows}


def _accept_one(
    store: PgTaskStore, batch: _AcceptBatch, item: AcceptItem, now: float,
    fingerprint: str, payload: str,
) -> AcceptResult:  # fmt: skip
    env = item.envelope
    if env.kind != "task":
        detail = f"kind {env.kind!r} does not become work"
        return AcceptResult(Outcome.NOT_TASK, detail=detail,
                            refusal=EnvelopeError("kind", "not_task", detail))  # fmt: skip
    key = (item.principal, env.message_id)
    retention_s = store.policy.retention_s
    row = batch.known.get(key)
    if row is not None and not _forgotten(retention_s, row, now):
        return _known(store, batch, item, row, fingerprint, now)
    if env.deadline > now + retention_s:
        detail = (
            f"deadline {env.deadline!r} is more than the retention window"
            f" ({retention_s:g} s) ahead of now ({now!r})"
        )
        return AcceptResult(Outcome.REFUSED, detail=detail,
                            refusal=EnvelopeError("deadline", "too_large", detail))  # fmt: skip
    task_id = next(batch.ids)
    hops = _hops(env, batch.parent_hops)
    state, outcome, error = TaskState.PENDING, Outcome.STORED, None
    if env.deadline <= now:
        state, outcome, error = TaskState.EXPIRED, Outcome.EXPIRED, "deadline already past"
    elif hops > store.policy.max_hops:
        state, outcome = TaskState.HOP_LIMIT, Outcome.HOP_LIMIT
        error = f"hops {hops} exceed the limit {store.policy.max_hops}"
    elif (chain := env.correlation_id) is not None:
        # The chain budget (``store.inbox``): counted per correlation_id, whoever sent it.
        stored = batch.chains.get(chain, 0)
        if stored >= store.policy.max_chain_tasks:
            state, outcome = TaskState.HOP_LIMIT, Outcome.HOP_LIMIT
            error = (
                f"chain {chain!r} has {stored} tasks: its budget of"
                f" {store.policy.max_chain_tasks} is spent"
            )
        else:
            batch.chains[chain] = stored + 1
            batch.chain_adds[chain] = batch.chain_adds.get(chain, 0) + 1
    batch.tasks.append(
        (
            task_id, item.principal, env.message_id, env.kind, payload,
            fingerprint, env.correlation_id, env.parent_id, state.value, env.max_attempts,
            now, env.deadline, hops, now, now,
            None if state is TaskState.PENDING else now, error, env.traceparent,
        )
    )  # fmt: skip
    batch.inbox.append((item.principal, env.message_id, fingerprint, task_id, item.entry_id, now))
    batch.known[key] = {
        "fingerprint": fingerprint, "task_id": task_id, "received_at": now,
        "state": state.value, "deadline": env.deadline,
    }  # fmt: skip
    reply_id = None
    if state is not TaskState.PENDING:
        reply_id = reply_id_for(task_id)
        t = {"principal": item.principal, "message_id": env.message_id,
             "correlation_id": env.correlation_id, "attempts": 0, "fence": 0,
             "traceparent": env.traceparent}  # fmt: skip
        batch.then.append(lambda c: write_reply(c, task_id, state, None, error, now, t=t))
    return AcceptResult(outcome, task_id, reply_id, error or "")


def _known(
    store: PgTaskStore, batch: _AcceptBatch, item: AcceptItem, row: Mapping[str, Any],
    fingerprint: str, now: float,
) -> AcceptResult:  # fmt: skip
    env = item.envelope
    key = (item.principal, env.message_id)
    if row["fingerprint"] == fingerprint:
        batch.duplicates.append(key)
        return AcceptResult(Outcome.DUPLICATE, row["task_id"])
    reply_id = store.conflict_reply_id(item.principal, env.message_id, fingerprint)
    detail = "message_id reused with different content; the first request stands"
    body = conflict_body(
        reply_id, row["task_id"], item.principal, env.message_id, env.correlation_id,
        detail, fingerprint, row["fingerprint"], traceparent=env.traceparent,
    )  # fmt: skip

    def write(c: Conn) -> None:
        c.execute(
            "UPDATE inbox SET conflicts = conflicts + 1 WHERE principal = %s AND message_id = %s",
            key,
        )
        enqueue(
            c, reply_id=reply_id, task_id=None, principal=item.principal,
            message_id=env.message_id, status=CONFLICT_STATUS, body=body, now=now,
        )  # fmt: skip

    batch.then.append(write)
    return AcceptResult(Outcome.CONFLICT, row["task_id"], reply_id, detail)
