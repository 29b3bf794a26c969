"""Settlement: a batch of handler outcomes committed in ONE fenced transaction.

``settle`` is the one way an outcome is committed (``TaskStore.settle_batch``; its
one-outcome forms ``TaskStore.finish`` and ``TaskStore.fail`` go through it too), on the
store's ``task_tx.TaskTx`` (its holder check, claim and take-back). Each
item is fenced on its own (``docs/RULES.md`` rule 10): an item the store refuses (stale
fence, lost lease, cancelled, deadline) is refused at its holder check, before it writes
anything, and reported; the others commit together, with the next batch's claim, in one
transaction: one fsync for all of them.

A success becomes ``done`` with its reply; a failure goes back to ``pending`` after a
backoff when it is retryable and the budget and the deadline allow, else ``failed`` with
its reply. Retries never extend the absolute deadline.

For a worker that publishes its own replies, the same transaction writes the new replies
already claimed by that publisher and marks its earlier confirmed publications sent, both
through the outbox's own functions (``enqueue_many`` with a ``PublisherClaim``,
``mark_sent_in``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final, Literal

from broker_adapter.config import DEFAULT_LEASE_S
from broker_adapter.errors import BrokerAdapterError, StaleError
from broker_adapter.protocol.reply import encode_body, reply_id_for, terminal_body
from broker_adapter.store.dbclock import tx_now, uses_server
from broker_adapter.store.fencing import TASK_HELD, update_held
from broker_adapter.store.lifecycle import ReplyKey, reply_key, reply_spec, to_terminal
from broker_adapter.store.outbox_types import OutboxRow, PublisherClaim, ReplySpec, SentMark
from broker_adapter.store.outbox_writes import enqueue_many, mark_sent_in
from broker_adapter.store.sql import Conn
from broker_adapter.store.task_tx import TaskTx
from broker_adapter.store.task_types import ClaimedTask, TaskState

#: The names of a settling transaction (its crash points are ``store.<name>.*``): ``finish``,
#: and ``fail`` for ``TaskStore.fail``.
SettleOp = Literal["finish", "fail"]
SETTLE_OPS: Final[tuple[SettleOp, ...]] = ("finish", "fail")


class FailOutcome(StrEnum):
    RETRY = "retry"
    FAILED = "failed"


@dataclass(frozen=True)
class Settlement:
    """One handler outcome: ``done`` when ``result`` (canonical JSON text) is set,
    otherwise a failure with ``error`` (back to ``pending`` if ``retryable`` and the budget
    and deadline allow)."""

    task_id: str
    owner: str
    fence: int
    result: str | None = None
    error: str | None = None
    retryable: bool = False
    claimed: ClaimedTask | None = None  # lets ``settle`` encode the reply up front
    retry_after_s: float | None = None  # the retry waits at least this (``RetryableError``)


#: What ``settle`` did with one item: reply id (done), failure outcome, or the refusal.
SettleResult = str | FailOutcome | StaleError


@dataclass(frozen=True)
class SettledBatch:
    """What ``settle`` did, in its one transaction.

    Attributes:
        results: one per item, in order: the reply id (done), a ``FailOutcome`` (failed or
            back to pending), or the ``StaleError`` that refused it.
        claimed: the tasks claimed for the next batch.
        replies: the terminal replies written already claimed by ``publish_as`` (state
            ``sending``, its lease, fence 1), to be published by it now.
        marks: one per ``sent`` mark: ``None`` when marked sent, else the refusal.
    """

    results: list[SettleResult]
    claimed: list[ClaimedTask]
    replies: list[OutboxRow] = field(default_factory=list)
    marks: list[StaleError | None] = field(default_factory=list)


#: Mark tasks done, fenced: the holder check is the WHERE clause of the state change, for
#: the rows of ``(task_id, result)`` given in ``{rows}`` that share one fence and owner
#: (``fencing.update_held``).
_MARK_DONE = (
    "UPDATE tasks SET state = 'done', owner = NULL, lease_until = NULL, updated_at = ?,"
    " finished_at = ?, result = v.column2, error = NULL FROM (VALUES {rows}) AS v"
    " WHERE task_id = v.column1 AND "
    + TASK_HELD
    + " RETURNING task_id, principal, message_id, correlation_id, attempts, fence, traceparent"
)


def settle(
    tx: TaskTx,
    items: Sequence[Settlement],
    owner: str,
    n: int,
    *,
    publish_as: str | None = None,
    publish_lease_s: float = DEFAULT_LEASE_S,
    sent: Sequence[SentMark] = (),
    op: SettleOp = "finish",
) -> SettledBatch:
    """Commit ``items`` and claim up to ``n`` tasks for ``owner`` (like ``claim``; nothing
    when ``n`` is 0) in ONE transaction (crash points ``store.<op>.before_commit`` and
    ``store.<op>.after_commit``, once per batch).

    Args:
        items: the outcomes, in the order the handlers ended.
        owner: who claims the next batch.
        n: how many tasks to claim at most.
        publish_as: a worker that publishes its own replies: the terminal replies are
            written already claimed by that publisher (what ``OutboxStore.claim`` would
            set: ``sending``, owner, lease of ``publish_lease_s``, attempts+1, fence+1);
            ``None`` leaves them ``pending`` for the dispatcher.
        publish_lease_s: the publisher's lease on the replies written now.
        sent: ``(reply_id, fence, entry_id, sent_at)`` of replies ``publish_as``
            published, marked sent (each fenced); needs ``publish_as``.
        op: the transaction's name (``finish``; ``TaskStore.fail`` keeps ``fail``).

    Raises:
        ValueError: ``sent`` without ``publish_as``.
        UnknownTask: an item names no task; nothing was written.
        StoreBusy, StoreError: the transaction as a whole failed; nothing was written.
    """
    if sent and publish_as is None:
        raise ValueError("sent marks need the publisher (publish_as) that holds them")
    out: list[SettleResult] = []
    if not items and n < 1 and not sent:
        return SettledBatch(out, [])
    # Replies of successes are encoded and hashed before the transaction (from what the
    # claim returned), so SQLite's write lock is held for the SQL only. Inside, each one is
    # used only if the row still says the same (it does whenever the fence matches). Where
    # the server's clock is the time (``dbclock``: PostgreSQL, whose writers lock rows, not
    # the database), they are built inside instead, at the transaction's time.
    server = uses_server(tx.db.dialect.server_clock, tx.clock)
    stamp = tx.clock.now()
    bodies = [None if server else _done_reply(item, stamp) for item in items]
    marks: list[StaleError | None] = []
    # A task named once in the batch (the rule) is marked done with the batch's others in
    # one statement; one named twice (a bug's, or a test's) goes item by item in batch
    # order, so the two stores end it alike.
    named = Counter(item.task_id for item in items)
    together = [i for i in items if i.result is not None and named[i.task_id] == 1]
    replies: list[ReplySpec] = []
    with tx.db.write(op) as c:
        now = tx_now(c, tx.clock)
        stamp = now if server else stamp
        claim = None if publish_as is None else PublisherClaim(publish_as, now + publish_lease_s)
        if sent:
            assert publish_as is not None
            marks = mark_sent_in(c, publish_as, sent, now)
        done = _mark_done(c, together, stamp, now)
        for item, body in zip(items, bodies, strict=True):
            # A refusal (StaleError) comes from the holder check, before this item wrote
            # anything; an error after its first write aborts the whole transaction.
            if item.result is not None:
                if named[item.task_id] > 1:
                    done.update(_mark_done(c, [item], stamp, now))
                row = done.pop(item.task_id, None)
                if row is None:
                    out.append(_refusal(tx, c, item))
                    continue
                encoded = body[1] if body is not None and body[0] == reply_key(row) else None
                replies.append(
                    reply_spec(item.task_id, TaskState.DONE, item.result, None, stamp, row, encoded)
                )
                out.append(replies[-1][0])
                continue
            try:
                row = tx.holder(c, item.task_id, item.owner, item.fence)
            except StaleError as exc:
                out.append(exc)
                continue
            error = item.error or ""
            out.append(
                _fail_row(
                    tx,
                    c,
                    row,
                    item.task_id,
                    error,
                    item.retryable,
                    now,
                    claim,
                    item.retry_after_s,
                )
            )
        if enqueue_many(c, replies, now, claim) != len(replies):  # the unique indexes
            raise BrokerAdapterError("a task of this batch was finished twice")
        rows = tx.claim_in(c, owner, n, now) if n >= 1 else []
    if n >= 1:
        tx.log_reconciled()
    written = [] if claim is None else _in_item_order(claim.rows, items)
    return SettledBatch(out, tx.claimed(rows, owner, now), written, marks)


def _mark_done(c: Conn, items: Sequence[Settlement], stamp: float, now: float) -> dict[str, Any]:
    """Mark the successes ``items`` done at ``stamp`` (``_MARK_DONE``: one statement per
    fence and owner they share, usually one), each fenced at ``now``: the rows it changed,
    by task id (what their replies are built from). An item it left alone wrote nothing."""
    by_holder: dict[tuple[int, str], list[tuple[str, str | None]]] = {}
    for item in items:
        by_holder.setdefault((item.fence, item.owner), []).append((item.task_id, item.result))
    rows = update_held(c, _MARK_DONE, by_holder, now, deadline=True, before=(stamp, stamp))
    return {r["task_id"]: r for r in rows}


def _refusal(tx: TaskTx, c: Conn, item: Settlement) -> StaleError:
    """Why ``_mark_done`` left ``item`` alone: the holder check's precise refusal."""
    try:
        tx.holder(c, item.task_id, item.owner, item.fence)
    except StaleError as exc:
        return exc
    return StaleError(item.task_id, "lease_expired")  # the clock moved on meanwhile


def _in_item_order(rows: list[OutboxRow], items: Sequence[Settlement]) -> list[OutboxRow]:
    """The replies written claimed, in the order of the items that ended their tasks."""
    order = {reply_id_for(item.task_id): i for i, item in reversed(list(enumerate(items)))}
    return sorted(rows, key=lambda r: order.get(r.reply_id, len(items)))


def _fail_row(
    tx: TaskTx,
    c: Conn,
    row: Any,
    task_id: str,
    error: str,
    retryable: bool,
    now: float,
    claim: PublisherClaim | None = None,
    retry_after_s: float | None = None,
) -> FailOutcome:
    if retryable and row["attempts"] < row["max_attempts"]:
        delay = tx.policy.backoff.delay(row["attempts"], tx.rng)
        not_before = now + max(delay, retry_after_s or 0.0)  # a target's Retry-After
        if not_before < row["deadline"]:
            c.execute(
                "UPDATE tasks SET state = 'pending', owner = NULL, lease_until = NULL,"
                " not_before = ?, error = ?, updated_at = ? WHERE task_id = ?",
                (not_before, c.dialect.text(error), now, task_id),
            )
            return FailOutcome.RETRY
        error = f"{error} (no retry: the deadline comes first)"
    elif retryable:
        error = f"{error} (attempts exhausted: {row['attempts']}/{row['max_attempts']})"
    to_terminal(c, task_id, TaskState.FAILED, now, error=error, row=row, claim=claim)
    return FailOutcome.FAILED


def _done_reply(item: Settlement, now: float) -> tuple[ReplyKey, tuple[bytes, str]] | None:
    """The encoded ``done`` reply of ``item``, built from its claim, or ``None``."""
    claimed = item.claimed
    if item.result is None or claimed is None:
        return None
    key = (
        claimed.principal,
        claimed.message_id,
        claimed.correlation_id,
        claimed.attempt,
        claimed.fence,
    )
    body = terminal_body(
        claimed.task_id,
        TaskState.DONE.value,
        *key[:3],
        item.result,
        None,
        *key[3:],
        now,
        traceparent=claimed.traceparent,
    )
    return key, encode_body(body)
