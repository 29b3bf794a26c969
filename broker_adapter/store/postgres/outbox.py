"""The transactional outbox on PostgreSQL: the same rows, rules and answers as
``store.outbox``, written for a database several processes write at once.

What changes against SQLite, where one writer at a time made a read-then-write safe:

* ``claim`` picks its rows with ``FOR UPDATE SKIP LOCKED``: two dispatchers (on two hosts)
  never wait on each other's rows and never take the same one; taking back rows whose
  publisher lease ran out skips locked rows the same way.
* every fenced write (mark sent, retry, dead) checks the holder in the WHERE clause of
  the UPDATE itself (fence, state ``sending``, owner, lease unexpired): the row lock the
  UPDATE takes and the check are one statement. When it matches nothing, a read of the
  row says why (``holder_refusal``) and nothing was written.
* ``enqueue`` inserts with ``ON CONFLICT DO NOTHING``: the unique indexes (reply id, one
  reply per task) decide, as SQLite's ``INSERT OR IGNORE``.
"""

from __future__ import annotations

import builtins
import random
from collections.abc import Sequence
from typing import Any

from broker_adapter.clock import Clock, SystemClock
from broker_adapter.errors import StaleError
from broker_adapter.protocol.reply import encode_body
from broker_adapter.store.fencing import REPLY_HELD_STATE, held_params, held_sql, refusal
from broker_adapter.store.outbox import (
    OUTBOX_STATES,
    OutboxPolicy,
    OutboxRow,
    PublisherClaim,
    SentMark,
    UnknownReply,
)
from broker_adapter.store.postgres.db import Conn, PgDatabase, Row, free_text

_COLUMNS = ", ".join(OutboxRow.__dataclass_fields__)
_O_COLUMNS = ", ".join("o." + name for name in OutboxRow.__dataclass_fields__)
#: Held by (fence, owner) at now: the publisher's side of rule 10 (``fencing``) in SQL.
REPLY_HELD = held_sql(REPLY_HELD_STATE, deadline=False, mark="%s")


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
    claim.rows.append(from_row(row))
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
    claim.rows.extend(from_row(r) for r in rows)
    return len(rows)


def from_row(row: Row) -> OutboxRow:
    values = {name: row[name] for name in OutboxRow.__dataclass_fields__}
    values["body"] = bytes(values["body"])
    return OutboxRow(**values)


def holder_refusal(
    c: Conn, reply_id: str, owner: str, fence: int, now: float
) -> StaleError | UnknownReply:
    """Why a fenced write of ``reply_id`` matched nothing (``UnknownReply`` if no row):
    ``fencing.refusal`` on the row as it is now."""
    row = c.execute(
        "SELECT state, owner, fence, lease_until FROM outbox WHERE reply_id = %s", (reply_id,)
    ).fetchone()
    if row is None:
        return UnknownReply(reply_id)
    why = refusal(row, reply_id, owner, fence, now, state=REPLY_HELD_STATE, deadline=False)
    return why or StaleError(reply_id, "lease_expired")  # the clock moved on meanwhile


def _held_update(
    c: Conn, reply_id: str, owner: str, fence: int, now: float, assignments: str,
    params: Sequence[Any], returning: str = "attempts",
) -> Row:  # fmt: skip
    """One fenced UPDATE of ``reply_id`` (the holder check its WHERE clause); raises the
    precise ``StaleError`` and writes nothing when the caller does not hold the row."""
    row = c.execute(
        f"UPDATE outbox SET {assignments} WHERE reply_id = %s AND {REPLY_HELD}"
        f" RETURNING {returning}",
        (*params, reply_id, *held_params(fence, owner, now, deadline=False)),
    ).fetchone()
    if row is None:
        raise holder_refusal(c, reply_id, owner, fence, now)
    return row


def mark_sent_in(
    c: Conn, owner: str, items: Sequence[SentMark], now: float
) -> builtins.list[StaleError | None]:
    """Record confirmed publications in the caller's transaction, each fenced on its own
    (``store.outbox.mark_sent_in``): ONE UPDATE whose WHERE clause holds the publisher's
    side of rule 10 per row; a row it left alone wrote nothing and gets
    ``holder_refusal``'s precise refusal (as does a second mark of one reply)."""
    first: dict[str, int] = {}
    for i, (reply_id, *_) in enumerate(items):
        first.setdefault(reply_id, i)
    chosen = [items[i] for i in first.values()]
    marked: set[int] = set()
    if chosen:
        rows = c.execute(
            "UPDATE outbox o SET state = 'sent', owner = NULL, lease_until = NULL,"
            " entry_id = v.entry_id, sent_at = v.sent_at, last_error = NULL"
            " FROM unnest(%s::text[], %s::bigint[], %s::text[], %s::float8[])"
            " AS v(reply_id, fence, entry_id, sent_at)"
            " WHERE o.reply_id = v.reply_id AND o.fence = v.fence AND o.state = 'sending'"
            " AND o.owner = %s AND o.lease_until > %s RETURNING o.reply_id",
            ([m[0] for m in chosen], [m[1] for m in chosen], [m[2] for m in chosen],
             [m[3] for m in chosen], owner, now),
        ).fetchall()  # fmt: skip
        marked = {first[r["reply_id"]] for r in rows}
    out: builtins.list[StaleError | None] = []
    for i, (reply_id, fence, _, _) in enumerate(items):
        if i in marked:
            out.append(None)
            continue
        why = holder_refusal(c, reply_id, owner, fence, now)
        if isinstance(why, UnknownReply):  # no such reply: as SQLite's, it aborts
            raise why
        out.append(why)
    return out


class PgOutboxStore:
    """Publisher-side access to the outbox (``store.outbox.OutboxStore``'s methods)."""

    def __init__(
        self,
        db: PgDatabase,
        clock: Clock | None = None,
        policy: OutboxPolicy | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.db = db
        self.clock = clock or SystemClock()
        self.policy = policy or OutboxPolicy()
        self.rng = rng or random.Random()

    def claim(self, owner: str, n: int) -> list[OutboxRow]:
        """Take up to ``n`` publishable replies: lease, attempts+1, fence+1."""
        if n < 1:
            return []
        now = self.clock.now()
        with self.db.write("outbox_claim") as c:
            return self._claim_in(c, owner, n, now)

    def _claim_in(self, c: Conn, owner: str, n: int, now: float) -> builtins.list[OutboxRow]:
        limit = self.policy.max_attempts
        c.execute(
            "UPDATE outbox o SET owner = NULL, lease_until = NULL,"
            " state = CASE WHEN o.attempts >= %s THEN 'dead' ELSE 'pending' END,"
            " last_error = CASE WHEN o.attempts >= %s"
            "   THEN 'publisher lease expired on the last attempt' ELSE o.last_error END"
            " FROM (SELECT reply_id FROM outbox WHERE state = 'sending' AND lease_until <= %s"
            "   FOR UPDATE SKIP LOCKED) AS lapsed WHERE o.reply_id = lapsed.reply_id",
            (limit, limit, now),
        )
        rows = c.execute(
            "UPDATE outbox o SET state = 'sending', owner = %s, lease_until = %s,"
            " attempts = o.attempts + 1, fence = o.fence + 1"
            " FROM (SELECT reply_id FROM outbox WHERE state = 'pending' AND not_before <= %s"
            "   ORDER BY not_before, created_at LIMIT %s FOR UPDATE SKIP LOCKED) AS picked"
            f" WHERE o.reply_id = picked.reply_id RETURNING {_O_COLUMNS}, o.not_before",
            (owner, now + self.policy.lease_s, now, n),
        ).fetchall()
        rows.sort(key=lambda r: (r["not_before"], r["created_at"]))
        return [from_row(r) for r in rows]

    def has_ready(self) -> bool:
        now = self.clock.now()
        row = self.db.fetch_one(
            "SELECT EXISTS (SELECT 1 FROM outbox WHERE state = 'pending' AND not_before <= %s)"
            " OR EXISTS (SELECT 1 FROM outbox WHERE state = 'sending' AND lease_until <= %s)"
            " AS ready",
            (now, now),
        )
        return row is not None and bool(row["ready"])

    def mark_sent(self, reply_id: str, owner: str, fence: int, entry_id: str) -> None:
        """Record a confirmed publication (fenced). Raises ``StaleError``."""
        now = self.clock.now()
        with self.db.write("mark_sent") as c:
            (refusal,) = mark_sent_in(c, owner, [(reply_id, fence, entry_id, now)], now)
        if refusal is not None:
            raise refusal

    def retry(self, reply_id: str, owner: str, fence: int, error: str) -> str:
        """A failed attempt: back in line after a backoff, or ``dead`` past the budget."""
        now = self.clock.now()
        with self.db.write("reply_retry") as c:
            row = _held_update(c, reply_id, owner, fence, now, "owner = owner", ())
            if row["attempts"] >= self.policy.max_attempts:
                state, not_before = "dead", now
            else:
                state = "pending"
                not_before = now + self.policy.backoff.delay(row["attempts"], self.rng)
            c.execute(
                "UPDATE outbox SET state = %s, owner = NULL, lease_until = NULL,"
                " not_before = %s, last_error = %s WHERE reply_id = %s AND fence = %s",
                (state, not_before, free_text(error), reply_id, fence),
            )
        return state

    def mark_dead(self, reply_id: str, owner: str, fence: int, error: str) -> None:
        """A permanent failure: ``dead`` at once, fenced."""
        now = self.clock.now()
        with self.db.write("reply_dead") as c:
            _held_update(
                c, reply_id, owner, fence, now,
                "state = 'dead', owner = NULL, lease_until = NULL, last_error = %s",
                (free_text(error),),
            )  # fmt: skip

    def replay(self, reply_id: str, by: str) -> OutboxRow:
        """Put a ``dead`` reply back in line under the same reply id."""
        now = self.clock.now()
        return self._move_dead(
            reply_id, by, "state = 'pending', attempts = 0, not_before = %s", (now,)
        )

    def mark_published(self, reply_id: str, entry_id: str, by: str) -> OutboxRow:
        """Reconcile a ``dead`` reply that Redis shows as published: ``sent``."""
        return self._move_dead(
            reply_id,
            by,
            "state = 'sent', owner = NULL, lease_until = NULL, entry_id = %s, sent_at = %s",
            (entry_id, self.clock.now()),
        )

    def _move_dead(
        self, reply_id: str, by: str, assignments: str, params: tuple[Any, ...]
    ) -> OutboxRow:
        now = self.clock.now()
        with self.db.write("reply_replay") as c:
            new = c.execute(
                f"UPDATE outbox SET {assignments}, replays = replays + 1, replayed_by = %s,"
                f" replayed_at = %s WHERE reply_id = %s AND state = 'dead' RETURNING {_COLUMNS}",
                (*params, by, now, reply_id),
            ).fetchone()
            if new is None:
                row = c.execute(
                    "SELECT state FROM outbox WHERE reply_id = %s", (reply_id,)
                ).fetchone()
                if row is None:
                    raise UnknownReply(reply_id)
                raise StaleError(reply_id, "not_dead", f"state is {row['state']}")
        return from_row(new)

    def requeue_sent(self, since: float | None = None, until: float | None = None) -> int:
        """Put ``sent`` replies back in line (Redis lost them)."""
        now = self.clock.now()
        low = since if since is not None else float("-inf")
        high = until if until is not None else float("inf")
        with self.db.write("reply_retry") as c:
            cur = c.execute(
                "UPDATE outbox SET state = 'pending', not_before = %s, attempts = 0"
                " WHERE state = 'sent' AND sent_at >= %s AND sent_at <= %s",
                (now, low, high),
            )
            return cur.rowcount

    def requeue_sent_near(self, restart_at: float, window_s: float) -> int:
        """Put back the ``sent`` replies a Redis restart at ``restart_at`` may have lost
        (``store.outbox.OutboxStore.requeue_sent_near``)."""
        now = self.clock.now()
        with self.db.write("reply_retry") as c:
            got = c.execute(
                "SELECT max(sent_at) AS last FROM outbox WHERE state = 'sent' AND sent_at < %s",
                (restart_at,),
            ).fetchone()
            last = None if got is None else got["last"]
            since = (restart_at if last is None else float(last)) - window_s
            cur = c.execute(
                "UPDATE outbox SET state = 'pending', not_before = %s, attempts = 0"
                " WHERE state = 'sent' AND sent_at >= %s AND sent_at <= %s",
                (now, since, restart_at + window_s),
            )
            return cur.rowcount

    def get(self, reply_id: str) -> OutboxRow | None:
        row = self.db.fetch_one(f"SELECT {_COLUMNS} FROM outbox WHERE reply_id = %s", (reply_id,))
        return None if row is None else from_row(row)

    def list(self, state: str | None = None, limit: int = 1000) -> list[OutboxRow]:
        sql = f"SELECT {_COLUMNS} FROM outbox"
        args: tuple[Any, ...] = ()
        if state is not None:
            sql += " WHERE state = %s"
            args = (state,)
        with self.db.read() as c:
            rows = c.execute(sql + " ORDER BY created_at LIMIT %s", (*args, limit)).fetchall()
        return [from_row(r) for r in rows]

    def counts(self) -> dict[str, int]:
        with self.db.read() as c:
            rows = c.execute("SELECT state, count(*) AS n FROM outbox GROUP BY state").fetchall()
        out = dict.fromkeys(OUTBOX_STATES, 0)
        out.update({r["state"]: r["n"] for r in rows})
        return out

    def oldest_unsent_age(self) -> float | None:
        row = self.db.fetch_one(
            "SELECT min(created_at) AS oldest FROM outbox WHERE state IN ('pending', 'sending')"
        )
        if row is None or row["oldest"] is None:
            return None
        return max(0.0, self.clock.now() - float(row["oldest"]))

    def mark_sent_and_claim(
        self, owner: str, items: Sequence[tuple[str, int, str]], n: int
    ) -> tuple[builtins.list[StaleError | None], builtins.list[OutboxRow]]:
        """Record confirmed publications (fenced per row) and claim up to ``n`` more rows,
        in ONE transaction."""
        if not items and n < 1:
            return [], []
        now = self.clock.now()
        marks = [(reply_id, fence, entry_id, now) for reply_id, fence, entry_id in items]
        with self.db.write("mark_sent") as c:
            out = mark_sent_in(c, owner, marks, now)
            claimed = self._claim_in(c, owner, n, now) if n >= 1 else []
        return out, claimed

    def mark_sent_marks(
        self, owner: str, marks: Sequence[SentMark]
    ) -> builtins.list[StaleError | None]:
        if not marks:
            return []
        with self.db.write("mark_sent") as c:
            return mark_sent_in(c, owner, marks, self.clock.now())
