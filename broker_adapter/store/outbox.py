"""The transactional outbox: replies written with their task's terminal state, published later.

One implementation for both stores, written against ``store.sql.Conn``. What it holds and
hands out (``OutboxRow``, ``OutboxPolicy``, ``PublisherClaim``, ...) is ``outbox_types``'s,
and what other transactions write into it (``enqueue``, ``mark_sent_in``) is
``outbox_writes``'s; both are imported from here as well.

A reply row is inserted inside the same transaction that makes its task terminal
(``enqueue`` takes the caller's connection), so a terminal task without its reply, or a
reply without its terminal task, cannot be observed. The unique index on ``task_id`` makes
"exactly one reply per terminal task" a database constraint.

The publisher side has its own lease and fence: ``claim`` hands a batch of rows to one
dispatcher (attempts+1, fence+1), and marking a row sent, ``retry`` and ``mark_dead`` succeed
only for the current holder (``fencing``). A confirmed publication is recorded one way,
``mark_sent_in``, whoever records it (the dispatcher's ``mark_sent_and_claim``, a worker's
``mark_sent_marks`` or its settling transaction). The body bytes are fixed at enqueue
time, so every resend carries the same reply id and the same bytes. ``dead`` means "no
trusted confirmation", not "not delivered": ``replay`` puts such a row back in line after
the operator checked Redis.

Several publishers may write at once (PostgreSQL, several hosts), so no write relies on a
single writer: a claim picks its rows with ``dialect.skip_locked`` (two dispatchers never
take the same row, nor wait on each other's); every fenced write checks the holder
(``fencing.REPLY_HELD``) in the WHERE clause of the statement that takes the row, and when
that matches nothing a read of the row says why (``holder_refusal``) and nothing was
written. The statements are the same on SQLite, where they cost what a read-then-write did.
"""

from __future__ import annotations

import builtins
import random
from collections.abc import Sequence
from typing import Any

from broker_adapter.clock import Clock, SystemClock
from broker_adapter.errors import StaleError
from broker_adapter.store.dbclock import read_now, tx_now
from broker_adapter.store.fencing import REPLY_HELD, claim_rows
from broker_adapter.store.outbox_types import (
    OUTBOX_STATES,
    OutboxPolicy,
    OutboxRow,
    SentMark,
    UnknownReply,
)
from broker_adapter.store.outbox_writes import (
    OUTBOX_COLUMNS,
    held_write,
    mark_sent_in,
)
from broker_adapter.store.sql import Conn, Db, in_lists

#: The ``meta`` row of the Redis epoch the dispatcher saw last (``stages.dispatch.loss``).
REDIS_EPOCH_META = "redis_epoch"


class OutboxStore:
    """Publisher-side access to the outbox, on either store.

    Args:
        db: the database (one per process): ``store.db.Database`` or
            ``store.postgres.PgDatabase``.
        clock: time source.
        policy: lease, attempt budget and backoff.
        rng: randomness for jitter (inject a seeded one in tests).
    """

    def __init__(
        self,
        db: Db,
        clock: Clock | None = None,
        policy: OutboxPolicy | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.db = db
        self.clock = clock or SystemClock()
        self.policy = policy or OutboxPolicy()
        self.rng = rng or random.Random()

    def claim(self, owner: str, n: int) -> list[OutboxRow]:
        """Take up to ``n`` publishable replies: lease, attempts+1, fence+1, one transaction.

        Rows whose publisher lease ran out are put back in line first.
        """
        if n < 1:  # SQLite reads LIMIT -1 as "no limit"
            return []
        with self.db.write("outbox_claim") as c:
            now = tx_now(c, self.clock)
            return self._claim_in(c, owner, n, now)

    def _claim_in(self, c: Conn, owner: str, n: int, now: float) -> builtins.list[OutboxRow]:
        """``claim``'s writes inside the caller's transaction. Both reads skip the rows
        another transaction is taking (``skip_locked``) and lock the rows they return."""
        d = c.dialect
        # A publisher that died holding the row spent an attempt too: past the budget the
        # row is dead (kept, with the reason), not claimed forever.
        c.execute(
            "UPDATE outbox SET owner = NULL, lease_until = NULL,"
            " state = CASE WHEN attempts >= ? THEN 'dead' ELSE 'pending' END,"
            " last_error = CASE WHEN attempts >= ?"
            "   THEN 'publisher lease expired on the last attempt' ELSE last_error END"
            f" WHERE reply_id IN (SELECT reply_id FROM outbox{d.indexed_by('outbox_leases')}"
            f" WHERE state = 'sending' AND lease_until <= ?{d.skip_locked})",
            (self.policy.max_attempts, self.policy.max_attempts, now),
        )
        rows = claim_rows(
            c,
            f"SELECT reply_id FROM outbox{d.indexed_by('outbox_ready')}"
            " WHERE state = 'pending' AND not_before <= ?"
            f" ORDER BY not_before, created_at LIMIT ?{d.skip_locked}",
            (now, n),
            "UPDATE outbox SET state = 'sending', owner = ?, lease_until = ?,"
            " attempts = attempts + 1, fence = fence + 1"
            f" WHERE reply_id IN ({{ids}}) RETURNING {OUTBOX_COLUMNS}",
            (owner, now + self.policy.lease_s),
            "reply_id",
        )
        return [OutboxRow.from_row(r) for r in rows]

    def has_ready(self) -> bool:
        """Whether ``claim`` would find a row now (ready, or a publisher lease run out). One
        read (no write lock, no fsync): an idle dispatcher asks this before claiming."""
        now = read_now(self.db, self.clock)
        d = self.db.dialect
        row = self.db.fetch_one(
            f"SELECT EXISTS (SELECT 1 FROM outbox{d.indexed_by('outbox_ready')}"
            " WHERE state = 'pending' AND not_before <= ?)"
            f" OR EXISTS (SELECT 1 FROM outbox{d.indexed_by('outbox_leases')}"
            " WHERE state = 'sending' AND lease_until <= ?) AS ready",
            (now, now),
        )
        return row is not None and bool(row["ready"])

    def mark_sent(self, reply_id: str, owner: str, fence: int, entry_id: str) -> None:
        """Record one confirmed publication (``mark_sent_marks`` of one, sent now).

        Raises:
            StaleError: the caller no longer holds the row; nothing is written.
        """
        (refused,) = self.mark_sent_marks(owner, [(reply_id, fence, entry_id, self.clock.now())])
        if refused is not None:
            raise refused

    def retry(self, reply_id: str, owner: str, fence: int, error: str) -> str:
        """Record a failed attempt: back in line after a backoff, or ``dead`` past the budget.

        Returns:
            the row's new state, ``"pending"`` or ``"dead"``.
        """
        with self.db.write("reply_retry") as c:
            now = tx_now(c, self.clock)
            # The fenced read takes the row (``for_update``): the backoff needs its attempts.
            row = held_write(
                c,
                f"SELECT attempts FROM outbox WHERE reply_id = ? AND {REPLY_HELD}"
                f"{c.dialect.for_update}",
                (),
                reply_id,
                owner,
                fence,
                now,
            )
            if row["attempts"] >= self.policy.max_attempts:
                state, not_before = "dead", now
            else:
                state = "pending"
                not_before = now + self.policy.backoff.delay(row["attempts"], self.rng)
            c.execute(
                "UPDATE outbox SET state = ?, owner = NULL, lease_until = NULL, not_before = ?,"
                " last_error = ? WHERE reply_id = ? AND fence = ?",
                (state, not_before, c.dialect.text(error), reply_id, fence),
            )
        return state

    def mark_dead(self, reply_id: str, owner: str, fence: int, error: str) -> None:
        """A permanent failure (e.g. a content conflict in Redis): ``dead`` at once, fenced."""
        with self.db.write("reply_dead") as c:
            now = tx_now(c, self.clock)
            held_write(
                c,
                "UPDATE outbox SET state = 'dead', owner = NULL, lease_until = NULL,"
                f" last_error = ? WHERE reply_id = ? AND {REPLY_HELD} RETURNING reply_id",
                (c.dialect.text(error),),
                reply_id,
                owner,
                fence,
                now,
            )

    def replay(self, reply_id: str, by: str) -> OutboxRow:
        """Put a ``dead`` reply back in line under the same reply id, recording who and when.

        Check the receiving side first (the dispatcher's ``replay`` does); this only moves
        the row.

        Raises:
            UnknownReply: no such reply.
            StaleError: the row is not ``dead`` (reason ``not_dead``), or older than
                ``policy.reply_window_s`` (reason ``stale``: a receiver would refuse it).
        """
        now = self.clock.now()
        row = self.get(reply_id)
        if row is not None and row.created_at < now - self.policy.reply_window_s:
            raise StaleError(
                reply_id,
                "stale",
                f"made {now - row.created_at:.0f} s ago, past the reply "
                f"window of {self.policy.reply_window_s:g} s",
            )
        return self._move_dead(
            reply_id, by, "state = 'pending', attempts = 0, not_before = ?", (now,)
        )

    def _move_dead(
        self, reply_id: str, by: str, assignments: str, params: tuple[Any, ...]
    ) -> OutboxRow:
        """The operator paths out of ``dead``: apply ``assignments`` and count a replay
        (``replays``, ``replayed_by``, ``replayed_at``), in one conditional UPDATE; a row
        it matched not is read to say why."""
        with self.db.write("reply_replay") as c:
            now = tx_now(c, self.clock)
            new = c.execute(
                f"UPDATE outbox SET {assignments}, replays = replays + 1, replayed_by = ?,"
                " replayed_at = ? WHERE reply_id = ? AND state = 'dead'"
                f" RETURNING {OUTBOX_COLUMNS}",
                (*params, by, now, reply_id),
            ).fetchone()
            if new is None:
                row = c.execute(
                    "SELECT state FROM outbox WHERE reply_id = ?", (reply_id,)
                ).fetchone()
                if row is None:
                    raise UnknownReply(reply_id)
                raise StaleError(reply_id, "not_dead", f"state is {row['state']}")
        return OutboxRow.from_row(new)

    def requeue_sent(self, since: float | None = None, until: float | None = None) -> int:
        """Put ``sent`` replies back in line (Redis lost them: a wipe or a lost AOF tail).

        Args:
            since: only rows sent at or after this time; ``None`` for every sent row.
            until: only rows sent at or before this time; ``None`` for no upper bound.

        Returns:
            how many rows were put back. The receiver dedupes the resends.
        """
        low = since if since is not None else float("-inf")
        high = until if until is not None else float("inf")
        with self.db.write("reply_retry") as c:
            return self._requeue_sent_in(c, low, high)

    def _requeue_sent_in(self, c: Conn, low: float, high: float) -> int:
        """Put back the ``sent`` rows sent between ``low`` and ``high``, except those made
        before the reply window (``policy.reply_window_s``: they are never sent again)."""
        now = tx_now(c, self.clock)
        cur = c.execute(
            "UPDATE outbox SET state = 'pending', not_before = ?, attempts = 0"
            " WHERE state = 'sent' AND sent_at >= ? AND sent_at <= ? AND created_at >= ?",
            (now, low, high, now - self.policy.reply_window_s),
        )
        return cur.rowcount

    def get(self, reply_id: str) -> OutboxRow | None:
        found = self.db.fetch_one(
            f"SELECT {OUTBOX_COLUMNS} FROM outbox WHERE reply_id = ?", (reply_id,)
        )
        return OutboxRow.from_row(found) if found else None

    def list(self, state: str | None = None, limit: int = 1000) -> list[OutboxRow]:
        sql = f"SELECT {OUTBOX_COLUMNS} FROM outbox"
        args: tuple[Any, ...] = ()
        if state is not None:
            sql += " WHERE state = ?"
            args = (state,)
        with self.db.read() as c:
            rows = c.execute(sql + " ORDER BY created_at LIMIT ?", (*args, limit)).fetchall()
        return [OutboxRow.from_row(r) for r in rows]

    def counts(self) -> dict[str, int]:
        with self.db.read() as c:
            rows = c.execute("SELECT state, count(*) AS n FROM outbox GROUP BY state").fetchall()
        out = dict.fromkeys(OUTBOX_STATES, 0)
        out.update({r["state"]: r["n"] for r in rows})
        return out

    def redis_epoch(self) -> str | None:
        """The Redis epoch the dispatcher saw last (``meta``); None before its first."""
        row = self.db.fetch_one("SELECT value FROM meta WHERE name = ?", (REDIS_EPOCH_META,))
        return None if row is None else bytes(row["value"]).decode("utf-8", "replace")

    def set_redis_epoch(self, epoch: str) -> None:
        """Keep ``epoch`` as the one the dispatcher saw (it survives a deleted epoch key)."""
        sql = "INSERT INTO meta (name, value) VALUES (?, ?) ON CONFLICT (name) DO UPDATE"
        with self.db.write("redis_epoch") as c:
            c.execute(sql + " SET value = excluded.value", (REDIS_EPOCH_META, epoch.encode()))

    def request_kids(self, task_ids: Sequence[str]) -> dict[str, str]:
        """The key id each task's request was signed with (tasks without one left out)."""
        out: dict[str, str] = {}
        with self.db.read() as c:
            for chunk, qs in in_lists(task_ids):
                sql = f"SELECT task_id, request_kid FROM tasks WHERE task_id IN ({qs})"
                rows = c.execute(sql, chunk).fetchall()
                out.update((r["task_id"], r["request_kid"]) for r in rows if r["request_kid"])
        return out

    def newest_sent(self, sent_before: float) -> OutboxRow | None:
        """The ``sent`` row sent last at or before ``sent_before`` (its publication record is
        the data-loss watch's evidence that Redis kept its data)."""
        found = self.db.fetch_one(
            f"SELECT {OUTBOX_COLUMNS} FROM outbox WHERE state = 'sent' AND sent_at <= ?"
            " ORDER BY sent_at DESC LIMIT 1",
            (sent_before,),
        )
        return OutboxRow.from_row(found) if found else None

    # -- batches (the dispatcher) ---------------------------------------------------------

    def mark_sent_and_claim(
        self, owner: str, items: Sequence[tuple[str, int, str]], n: int
    ) -> tuple[builtins.list[StaleError | None], builtins.list[OutboxRow]]:
        """Record a batch of confirmed publications (fenced per row) and claim up to ``n``
        more rows (like ``claim``; none when ``n`` is 0) in ONE transaction.

        A row the caller no longer holds is refused by its fenced update, which writes
        nothing, and reported; the others commit together (one fsync for the batch).

        Args:
            owner: the dispatcher that claimed the rows (and claims the next ones).
            items: ``(reply_id, fence, entry_id)`` per row.
            n: how many rows to claim at most.

        Returns:
            one entry per item, in order: ``None`` when marked sent, else the ``StaleError``
            (a ``FencedError`` for a newer fence) that refused it; and the claimed rows.
        """
        if not items and n < 1:
            return [], []
        now = self.clock.now()
        sent = [(reply_id, fence, entry_id, now) for reply_id, fence, entry_id in items]
        return self._mark_sent(owner, sent, n)

    def mark_sent_marks(
        self, owner: str, marks: Sequence[SentMark]
    ) -> builtins.list[StaleError | None]:
        """``mark_sent_and_claim`` without the claim, with the time of each confirmation
        (``SentMark``) as its ``sent_at``: one transaction, each row fenced on its own."""
        if not marks:
            return []
        return self._mark_sent(owner, marks, 0)[0]

    def _mark_sent(
        self, owner: str, sent: Sequence[SentMark], n: int
    ) -> tuple[builtins.list[StaleError | None], builtins.list[OutboxRow]]:
        """The ``mark_sent`` transaction: ``mark_sent_in``, then a claim of up to ``n``."""
        with self.db.write("mark_sent") as c:
            now = tx_now(c, self.clock)
            out = mark_sent_in(c, owner, sent, now)
            claimed = self._claim_in(c, owner, n, now) if n >= 1 else []
        return out, claimed

    def mark_published(self, reply_id: str, entry_id: str, by: str) -> OutboxRow:
        """Reconcile a ``dead`` reply that Redis shows as published: ``sent`` with that entry id.

        Used by the operator's replay after the publication record in Redis was found with
        the same content hash. Counts as a replay (``replays``, ``replayed_by``,
        ``replayed_at``); ``last_error`` is kept as the record of why it went dead.

        Raises:
            UnknownReply: no such reply.
            StaleError: the row is not ``dead``.
        """
        return self._move_dead(
            reply_id,
            by,
            "state = 'sent', owner = NULL, lease_until = NULL, entry_id = ?, sent_at = ?",
            (entry_id, self.clock.now()),
        )

    def requeue_sent_near(self, restart_at: float, window_s: float) -> int:
        """Put back the ``sent`` replies a Redis restart at ``restart_at`` may have lost.

        Those are the rows sent in the ``window_s`` seconds before the last send that
        precedes ``restart_at`` (Redis was down in between, so nothing was sent), up to
        ``restart_at + window_s`` (slack for the restart time being an estimate).

        Returns:
            how many rows were put back. The publication records in Redis make a resend of
            a reply that did survive a no-op.
        """
        with self.db.write("reply_retry") as c:
            got = c.execute(
                "SELECT max(sent_at) AS last FROM outbox WHERE state = 'sent' AND sent_at < ?",
                (restart_at,),
            ).fetchone()
            last = None if got is None else got["last"]
            since = (restart_at if last is None else float(last)) - window_s
            return self._requeue_sent_in(c, since, restart_at + window_s)
