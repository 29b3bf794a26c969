"""What other transactions write into the outbox, on the caller's connection: a reply
inserted in the transaction that makes its task terminal (``enqueue``, ``enqueue_many``,
possibly already claimed by the worker that publishes it), and a confirmed publication
marked sent (``mark_sent_in``, the one way a reply is marked sent), each fenced by the
publisher's holder rule (``fencing.REPLY_HELD``; ``held_write`` and ``holder_refusal`` say
why a fenced write matched nothing).

``lifecycle`` (terminal replies), ``inbox`` (conflict answers), ``settle`` (a worker's own
publications) and ``outbox.OutboxStore`` (the publisher's transactions) all write through
these functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from broker_adapter.errors import StaleError
from broker_adapter.protocol.reply import encode_body
from broker_adapter.store.fencing import (
    REPLY_HELD,
    REPLY_HELD_STATE,
    fence_refusal,
    held_params,
    update_held,
)
from broker_adapter.store.outbox_types import (
    OutboxRow,
    PublisherClaim,
    ReplySpec,
    SentMark,
    UnknownReply,
)
from broker_adapter.store.sql import Conn

#: The columns of an ``OutboxRow``.
OUTBOX_COLUMNS = ", ".join(OutboxRow.__dataclass_fields__)


def enqueue(
    conn: Conn,
    *,
    reply_id: str,
    task_id: str | None,
    principal: str,
    message_id: str,
    status: str,
    body: dict[str, Any],
    now: float,
) -> bool:
    """Insert a reply inside the caller's open transaction (either store's: ``store.sql``).
    Returns False if it existed."""
    data, content_hash = encode_body(body)
    spec = (reply_id, task_id, principal, message_id, status, data, content_hash)
    return enqueue_many(conn, [spec], now) == 1


#: Replies per INSERT of ``enqueue_many`` (at most 11 parameters each: within SQLite's
#: limit on bound parameters).
_ENQUEUE_CHUNK = 64
_INSERT_NAMES = "reply_id, task_id, principal, message_id, status, body, content_hash"


def enqueue_many(
    conn: Conn, replies: Sequence[ReplySpec], now: float, claim: PublisherClaim | None = None
) -> int:
    """Insert replies inside the caller's open transaction, a batch in one statement (a
    settled batch's replies: one round trip on PostgreSQL, not one per reply). A reply id,
    or a task's one reply, already there is skipped (``ON CONFLICT DO NOTHING``: the unique
    indexes decide). Returns how many were inserted.

    With ``claim`` the rows are written already claimed by that publisher (``sending``, its
    owner and lease, attempts 1, fence 1: what ``OutboxStore.claim`` would set) and are
    appended to ``claim.rows`` in the order of ``replies``; nobody else takes them before
    the lease runs out.
    """
    inserted = 0
    for start in range(0, len(replies), _ENQUEUE_CHUNK):
        chunk = replies[start : start + _ENQUEUE_CHUNK]
        if claim is None:
            cur = conn.execute(
                f"INSERT INTO outbox ({_INSERT_NAMES}, state, not_before, created_at) VALUES "
                + ", ".join(["(?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?)"] * len(chunk))
                + " ON CONFLICT DO NOTHING",
                [v for spec in chunk for v in (*spec, now, now)],
            )
            inserted += cur.rowcount
            continue
        rows = conn.execute(
            f"INSERT INTO outbox ({_INSERT_NAMES}, state, owner, lease_until, attempts, fence,"
            " not_before, created_at) VALUES "
            + ", ".join(["(?, ?, ?, ?, ?, ?, ?, 'sending', ?, ?, 1, 1, ?, ?)"] * len(chunk))
            + f" ON CONFLICT DO NOTHING RETURNING {OUTBOX_COLUMNS}",
            [v for spec in chunk for v in (*spec, claim.owner, claim.lease_until, now, now)],
        ).fetchall()
        written = {r["reply_id"]: OutboxRow.from_row(r) for r in rows}
        claim.rows.extend(written[spec[0]] for spec in chunk if spec[0] in written)
        inserted += len(rows)
    return inserted


def holder_refusal(
    c: Conn, reply_id: str, owner: str, fence: int, now: float
) -> StaleError | UnknownReply:
    """Why a fenced write of ``reply_id`` matched nothing (``UnknownReply`` if no row):
    ``fencing.fence_refusal`` on the row as it is now."""
    row = c.execute(
        "SELECT state, owner, fence, lease_until FROM outbox WHERE reply_id = ?", (reply_id,)
    ).fetchone()
    if row is None:
        return UnknownReply(reply_id)
    why = fence_refusal(row, reply_id, owner, fence, now, state=REPLY_HELD_STATE, deadline=False)
    return why or StaleError(reply_id, "lease_expired")  # the clock moved on meanwhile


def held_write(
    c: Conn, sql: str, params: Sequence[Any], reply_id: str, owner: str, fence: int, now: float
) -> Any:
    """The row of ONE fenced statement on ``reply_id`` (``sql`` ends in the holder check,
    ``REPLY_HELD``, and returns a row); raises the precise refusal when it matched nothing,
    having written nothing."""
    row = c.execute(sql, (*params, reply_id, *held_params(fence, owner, now, deadline=False)))
    found = row.fetchone()
    if found is None:
        raise holder_refusal(c, reply_id, owner, fence, now)
    return found


#: Mark sent, fenced: the rows of one fence, ``(reply_id, entry_id, sent_at)`` each (its
#: ``VALUES`` list, columns ``column1``..``column3`` on both engines), held by one owner
#: (``fencing.update_held``).
_MARK_SENT = (
    "UPDATE outbox SET state = 'sent', owner = NULL, lease_until = NULL,"
    " entry_id = v.column2, sent_at = v.column3, last_error = NULL FROM (VALUES {rows}) AS v"
    " WHERE reply_id = v.column1 AND " + REPLY_HELD + " RETURNING reply_id"
)


def mark_sent_in(
    c: Conn, owner: str, items: Sequence[SentMark], now: float
) -> list[StaleError | None]:
    """Record confirmed publications inside the caller's transaction, each fenced on its
    own: the holder check (``fencing.REPLY_HELD``) is the WHERE clause of the update, one
    statement for the items of one fence (a batch's usually share it); an item it left
    alone wrote nothing and gets ``holder_refusal``'s precise refusal (as does a second
    mark of one reply). The one way a reply is marked sent.

    Returns:
        one entry per item, in order: ``None`` when marked sent, else the ``StaleError``.

    Raises:
        UnknownReply: an item names no reply (the transaction is to be abandoned).
    """
    first: dict[str, int] = {}
    by_holder: dict[tuple[int, str], list[tuple[str, str, float]]] = {}
    for i, (reply_id, fence, entry_id, sent_at) in enumerate(items):
        if first.setdefault(reply_id, i) == i:
            by_holder.setdefault((fence, owner), []).append((reply_id, entry_id, sent_at))
    rows = update_held(c, _MARK_SENT, by_holder, now, deadline=False)
    marked = {r["reply_id"] for r in rows}
    out: list[StaleError | None] = []
    for i, (reply_id, fence, _, _) in enumerate(items):
        if first[reply_id] == i and reply_id in marked:
            out.append(None)
            continue
        why = holder_refusal(c, reply_id, owner, fence, now)
        if isinstance(why, UnknownReply):
            raise why
        out.append(why)
    return out
