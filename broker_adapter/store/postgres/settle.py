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

from broker_adapter.errors import BrokerAdapterError, StaleError
from broker_adapter.store.leases import DEFAULT_LEASE_S
from broker_adapter.store.lifecycle import TaskState, reply_key
from broker_adapter.store.outbox import PublisherClaim, SentMark
from broker_adapter.store.postgres.db import Conn, Row, free_text
from broker_adapter.store.postgres.lifecycle import to_terminal, write_reply
from broker_adapter.store.postgres.outbox import mark_sent_in
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

_MARK_DONE_SET = (
    "state = 'done', owner = NULL, lease_until = NULL, updated_at = %s, finished_at = %s,"
    " result = %s, error = NULL"
)


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
        for item, body in zip(items, bodies, strict=True):
            try:
                if item.result is not None:
                    row = store._hold(c, item.task_id, item.owner, item.fence, _MARK_DONE_SET,
                                      (now, now, item.result))  # fmt: skip
                    out.append(_done(c, item, row, body, now, claim))
                else:
                    row = store._hold(c, item.task_id, item.owner, item.fence)
                    out.append(_failure(store, c, row, item, now, claim))
            except StaleError as exc:
                out.append(exc)
        rows = store._claim_in(c, owner, n, now) if n >= 1 else []
    replies = [] if claim is None else claim.rows
    return SettledBatch(out, store._claimed(rows, owner, now), replies, marks)


def _done(
    c: Conn, item: Settlement, row: Row, body: tuple[object, tuple[bytes, str]] | None,
    now: float, claim: PublisherClaim | None,
) -> str:  # fmt: skip
    """The reply of an item just marked done (same transaction)."""
    encoded = body[1] if body is not None and body[0] == reply_key(row) else None
    try:
        return write_reply(
            c, item.task_id, TaskState.DONE, item.result, None, now, row, encoded, claim
        )
    except StaleError as exc:  # a second terminal reply: a bug, never a refusal
        raise BrokerAdapterError(f"task {item.task_id} was finished twice: {exc}") from exc


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
