"""What only PostgreSQL says of the outbox (``store.outbox`` is the one implementation):
its inserts (``ON CONFLICT DO NOTHING`` for SQLite's ``INSERT OR IGNORE``; the unique
indexes, reply id and one reply per task, decide), and a settled batch's replies in ONE
statement (``enqueue_many``, arrays through ``unnest``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from broker_adapter.protocol.reply import encode_body
from broker_adapter.store.outbox import OutboxRow, PublisherClaim
from broker_adapter.store.postgres.db import Conn

_COLUMNS = ", ".join(OutboxRow.__dataclass_fields__)


def enqueue(
    c: Conn, *, reply_id: str, task_id: str | None, principal: str, message_id: str,
    status: str, body: dict[str, Any], now: float,
) -> bool:  # fmt: skip
    """Insert a reply inside the caller's transaction. Returns False if it existed."""
    data, content_hash = encode_body(body)
    return enqueue_encoded(
        c, reply_id=reply_id, task_id=task_id, principal=principal, message_id=message_id,
        status=status, data=data, content_hash=content_hash, now=now,
    )  # fmt: skip


def enqueue_encoded(
    c: Conn, *, reply_id: str, task_id: str | None, principal: str, message_id: str,
    status: str, data: bytes, content_hash: str, now: float,
    claim: PublisherClaim | None = None,
) -> bool:  # fmt: skip
    """``store.outbox.enqueue_encoded`` on PostgreSQL: with ``claim`` the row is written
    already claimed by that publisher and appended to ``claim.rows``."""
    if claim is None:
        cur = c.execute(
            "INSERT INTO outbox (reply_id, task_id, principal, message_id, status, body,"
            " content_hash, state, not_before, created_at)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, 'pending', %s, %s) ON CONFLICT DO NOTHING",
            (reply_id, task_id, principal, message_id, status, data, content_hash, now, now),
        )
        return cur.rowcount == 1
    row = c.execute(
        "INSERT INTO outbox (reply_id, task_id, principal, message_id, status, body,"
        " content_hash, state, owner, lease_until, attempts, fence, not_before, created_at)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, 'sending', %s, %s, 1, 1, %s, %s)"
        f" ON CONFLICT DO NOTHING RETURNING {_COLUMNS}",
        (reply_id, task_id, principal, message_id, status, data, content_hash, claim.owner,
         claim.lease_until, now, now),
    ).fetchone()  # fmt: skip
    if row is None:
        return False
    claim.rows.append(OutboxRow.from_row(row))
    return True


#: One reply for ``enqueue_many``: reply id, task id, principal, message id, status, the
#: body's bytes and their hash.
ReplySpec = tuple[str, str | None, str, str, str, bytes, str]


def enqueue_many(
    c: Conn, replies: Sequence[ReplySpec], now: float, claim: PublisherClaim | None = None
) -> int:
    """``enqueue_encoded`` for many replies in ONE statement (a settled batch's): how many
    were inserted (a reply id, or a task's one reply, already there is skipped). With
    ``claim`` they are written claimed by that publisher and appended to ``claim.rows``."""
    if not replies:
        return 0
    columns = list(zip(*replies, strict=True))
    arrays = (
        "unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[], %s::bytea[],"
        " %s::text[]) AS r(reply_id, task_id, principal, message_id, status, body, content_hash)"
    )
    names = "reply_id, task_id, principal, message_id, status, body, content_hash"
    if claim is None:
        cur = c.execute(
            f"INSERT INTO outbox ({names}, state, not_before, created_at)"
            f" SELECT {names}, 'pending', %s, %s FROM {arrays} ON CONFLICT DO NOTHING",
            (now, now, *map(list, columns)),
        )
        return cur.rowcount
    rows = c.execute(
        f"INSERT INTO outbox ({names}, state, owner, lease_until, attempts, fence, not_before,"
        f" created_at) SELECT {names}, 'sending', %s, %s, 1, 1, %s, %s FROM {arrays}"
        f" ON CONFLICT DO NOTHING RETURNING {_COLUMNS}",
        (claim.owner, claim.lease_until, now, now, *map(list, columns)),
    ).fetchall()
    claim.rows.extend(OutboxRow.from_row(r) for r in rows)
    return len(rows)
