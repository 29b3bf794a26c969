"""Settlement on PostgreSQL: a batch of handler outcomes committed in ONE transaction,
each fenced on its own in the WHERE clause of its UPDATE (``tasks.TASK_HELD``).

The same outcomes and answers as the SQLite store's settle path: a success becomes
``done`` with its reply; a failure goes back to ``pending`` after a backoff when it is
retryable and the budget and the deadline allow, else ``failed`` with its reply; a refused
item (stale fence, lost lease, cancelled, deadline) writes nothing and is reported; for a
worker that publishes its own replies, the new replies are written already claimed by it
and its earlier confirmed publications are marked sent, in the same transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from broker_adapter.config import DEFAULT_LEASE_S
from broker_adapter.errors import BrokerAdapterError, StaleError
from broker_adapter.protocol.reply import encode_body, reply_id_for, terminal_body
from broker_adapter.store.lifecycle import TaskState, reply_key
from broker_adapter.store.outbox import OutboxRow, PublisherClaim, SentMark, mark_sent_in
from broker_adapter.store.postgres.db import Conn, Row, free_text
from broker_adapter.store.postgres.lifecycle import to_terminal
from broker_adapter.store.postgres.outbox import ReplySpec, enqueue_many
from broker_adapter.store.settle import (
    FailOutcome,
    SettledBatch,
    Settlement,
    SettleOp,
    SettleResult,
    _done_reply,
)

if TYPE_CHECKING:
    from broker_adapter.store.postgres.tasks import PgTaskStore


def settle(
    store: PgTaskStore,
    items: Sequence[Settlement],
    owner: str,
    n: int,
    *,
    publish_as: str | None = None,
    publish_lease_s: float = DEFAULT_LEASE_S,
    sent: Sequence[SentMark] = (),
    op: SettleOp = "finish",
) -> SettledBatch:
    """Commit ``items`` and claim up to ``n`` tasks for ``owner`` in ONE transaction
    (crash points ``store.<op>.before_commit`` / ``after_commit``); the arguments and
    results are ``store.settle.settle``'s.

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
    now = store.clock.now()
    bodies = [_done_reply(item, now) for item in items]
    claim = None if publish_as is None else PublisherClaim(publish_as, now + publish_lease_s)
    marks: list[StaleError | None] = []
    with store.db.write(op) as c:
        if sent:
            assert publish_as is not None
            marks = mark_sent_in(c, publish_as, sent, store.clock.now())
        held = _mark_done(store, c, items, now)
        replies: list[ReplySpec] = []
        for i, (item, body) in enumerate(zip(items, bodies, strict=True)):
            try:
                if item.result is not None:
                    row = held.get(i)
                    if row is None:
                        raise store._why_not(
                            c, item.task_id, item.owner, item.fence, store.clock.now()
                        )
                    replies.append(_done_reply_spec(item, row, body, now))
                    out.append(replies[-1][0])
                else:
                    row = store._hold(c, item.task_id, item.owner, item.fence)
                    out.append(_failure(store, c, row, item, now, claim))
            except StaleError as exc:
                out.append(exc)
        if enqueue_many(c, replies, now, claim) != len(replies):  # the unique indexes
            raise BrokerAdapterError("a task of this batch was finished twice")
        rows = store._claim_in(c, owner, n, now) if n >= 1 else []
    if n >= 1:
        store._log_reconciled()
    replies_claimed = [] if claim is None else _in_item_order(claim.rows, items)
    return SettledBatch(out, store._claimed(rows, owner, now), replies_claimed, marks)


def _mark_done(
    store: PgTaskStore, c: Conn, items: Sequence[Settlement], now: float
) -> dict[int, Row]:
    """Mark every success of ``items`` done in ONE fenced UPDATE (rule 10 its WHERE
    clause, per row): the rows it changed, by item index. An item it left alone (stale,
    cancelled, lease or deadline passed, or a second success for one task) is not in it:
    the caller asks ``_why_not``, which writes nothing."""
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        if item.result is not None:
            first.setdefault(item.task_id, i)
    if not first:
        return {}
    chosen = [items[i] for i in first.values()]
    check_at = store.clock.now()
    rows = c.execute(
        "UPDATE tasks t SET state = 'done', owner = NULL, lease_until = NULL,"
        " updated_at = %s, finished_at = %s, result = v.result, error = NULL"
        " FROM unnest(%s::text[], %s::bigint[], %s::text[], %s::text[])"
        " AS v(task_id, fence, owner, result)"
        " WHERE t.task_id = v.task_id AND t.fence = v.fence AND t.state = 'running'"
        " AND t.owner = v.owner AND t.lease_until > %s AND t.deadline > %s"
        " RETURNING t.task_id, t.principal, t.message_id, t.correlation_id, t.attempts,"
        " t.fence, t.traceparent",
        (now, now, [i.task_id for i in chosen], [i.fence for i in chosen],
         [i.owner for i in chosen], [i.result for i in chosen], check_at, check_at),
    ).fetchall()  # fmt: skip
    return {first[r["task_id"]]: r for r in rows}


def _done_reply_spec(
    item: Settlement, row: Row, body: tuple[object, tuple[bytes, str]] | None, now: float
) -> ReplySpec:
    """The reply of an item just marked done: encoded before the transaction from its
    claim when the row says the same, else now from the row."""
    if body is not None and body[0] == reply_key(row):
        data, content_hash = body[1]
    else:
        data, content_hash = encode_body(
            terminal_body(item.task_id, TaskState.DONE.value, row["principal"],
                          row["message_id"], row["correlation_id"], item.result, None,
                          row["attempts"], row["fence"], now, traceparent=row["traceparent"])
        )  # fmt: skip
    return (reply_id_for(item.task_id), item.task_id, row["principal"], row["message_id"],
            TaskState.DONE.value, data, content_hash)  # fmt: skip


def _in_item_order(rows: list[OutboxRow], items: Sequence[Settlement]) -> list[OutboxRow]:
    """The replies written claimed, in the order of the items that ended their tasks."""
    order = {reply_id_for(item.task_id): i for i, item in reversed(list(enumerate(items)))}
    return sorted(rows, key=lambda r: order.get(r.reply_id, len(items)))


def _failure(
    store: PgTaskStore, c: Conn, row: Row, item: Settlement, now: float,
    claim: PublisherClaim | None,
) -> FailOutcome:  # fmt: skip
    error = item.error or ""
    if item.retryable and row["attempts"] < row["max_attempts"]:
        not_before = now + store.policy.backoff.delay(row["attempts"], store.rng)
        if not_before < row["deadline"]:
            c.execute(
                "UPDATE tasks SET state = 'pending', owner = NULL, lease_until = NULL,"
                " not_before = %s, error = %s, updated_at = %s WHERE task_id = %s",
                (not_before, free_text(error), now, item.task_id),
            )
            return FailOutcome.RETRY
        error = f"{error} (no retry: the deadline comes first)"
    elif item.retryable:
        error = f"{error} (attempts exhausted: {row['attempts']}/{row['max_attempts']})"
    to_terminal(c, item.task_id, TaskState.FAILED, now, error=error, row=row, claim=claim)
    return FailOutcome.FAILED
