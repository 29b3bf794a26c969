"""Retention: what the stores forget once the dedupe window has passed, a small batch at a time.

One window per process, ``retention_s`` (7 days by default). On the adapter's side a
request goes as a whole, in ONE transaction: its task row, its inbox record (if the record
still names this task: a message id reused past the window took it over), its terminal
reply in the outbox and its effect records (reconcile log, compensations, approval wait);
approvals expired or revoked before the window go with any batch that deletes. It goes
only when all of these hold, re-checked inside the deleting transaction:

* the task is terminal and its deadline has passed (a replay of the envelope can then only
  be accepted as ``expired``, never run);
* it was accepted at least ``retention_s`` ago (the inbox record dedupes that long:
  the intake, ``inbox``);
* its reply was sent, at least ``retention_s`` ago (the outbox row outlives the reply's
  stream entry, so an operator can still publish it again under the same id).

A request whose task is live, or whose reply is pending, sending, dead or sent within the
window, is never touched. Conflict answers (outbox rows without a task) go once sent and
past the window. On the receiver's side a receipt goes once applied ``retention_s`` ago
(``ReceiptStore.purge_batch``; the receiver also keeps those of entries still pending in
its group).

Batches. One text for both stores (``store.sql``: the dialect names the few words each
says its own way). Candidates are found by a read (no write lock) that walks the tasks
table oldest first (SQLite's rowid, PostgreSQL's ``seq``), from a cursor the caller
carries through a pass, and stops at the first row accepted inside the window; the write
transaction then deletes at most ``PURGE_BATCH`` requests by primary key and index, a few
milliseconds of write lock. On PostgreSQL, where several processes write at once, it
takes each candidate's row locks as it re-checks the rule (``FOR UPDATE SKIP LOCKED``: a
row another transaction holds is left for the next pass). Rows that must stay (a dead
reply) are walked past once per pass, not deleted. A pass is a loop of batches;
``PurgeSchedule`` spaces the batches so that live writers take the lock in between, and
the passes ``PURGE_EVERY_S`` apart.

File size. SQLite puts the pages a DELETE frees on the file's freelist and the next
inserts take them from there, so a database whose rows come and go at the same rate stops
growing at the size of one window of rows; ``auto_vacuum`` is left off (turning it on for
an existing file takes a full ``VACUUM``, and returning pages to the OS only to grow again
costs writes for nothing). An operator who wants the space of a burst back runs
``broker-adapter backup`` (``VACUUM INTO``, compact) or ``VACUUM`` while stopped.
PostgreSQL's autovacuum reclaims the deleted rows' space for new ones.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from broker_adapter.clock import Clock
from broker_adapter.errors import BrokerAdapterError
from broker_adapter.store.db import Database
from broker_adapter.store.sql import Conn, Db, Dialect, in_lists
from broker_adapter.store.task_types import TERMINAL_SQL

#: Requests (or receipts) deleted per transaction at most.
PURGE_BATCH = 100
#: Rows a candidate read looks at per batch at most (it stops earlier at the window).
SCAN_ROWS = 4 * PURGE_BATCH
#: Seconds between purge passes.
PURGE_EVERY_S = 5.0
#: Pause between the batches of a pass, at least, and as a multiple of the batch's own
#: transaction time: while it catches up, the purge takes at most about half of the write
#: lock's time (about 6,000 requests a second with 8 ms commits), the live writers the rest.
PURGE_PAUSE_S = 0.002
PURGE_PAUSE_FACTOR = 1.0


def purgeable_sql(d: Dialect) -> str:
    """The rule of a purgeable request, on ``tasks t`` joined with its reply ``outbox o``,
    with the parameters of ``_rule_params``. The one place it is written: the candidate
    read and the deleting transaction both use it. ``o.state`` is kept off SQLite's index on
    the outbox's state (``Dialect.unindexed``), which would walk every sent reply instead of
    the batch's."""
    return (
        f"t.state IN {TERMINAL_SQL} AND t.deadline <= ? AND t.created_at <= ?"
        f" AND {d.unindexed('o.state')} = 'sent' AND o.sent_at <= ?"
    )


def _rule_params(now: float, cutoff: float) -> tuple[float, float, float]:
    return now, cutoff, cutoff


def purge_requests(
    db: Db, now: float, retention_s: float, after: int = 0, limit: int = PURGE_BATCH
) -> PurgeBatch:
    """Delete at most ``limit`` purgeable requests (see the module docstring) whose task
    row comes after cursor ``after`` (``Dialect.rowid``), and up to ``limit`` conflict
    answers past the window, in one transaction.

    The candidates are read first, outside the writing transaction; the deleting
    transaction checks each again (the rule: a reply put back in line by a data-loss
    resend since the read is no longer sent, and stays), taking its rows' locks on
    PostgreSQL (``skip_locked``: a row another transaction holds is left for the next
    pass), and deletes the request's inbox record, reply and task together, so that no
    crash leaves a task without its record, or a record without its task.
    """
    cutoff = now - retention_s
    rule = _rule_params(now, cutoff)
    d = db.dialect
    purgeable = purgeable_sql(d)
    with db.read() as c:
        rows = c.execute(
            f"SELECT t.{d.rowid} AS seq, t.task_id, coalesce({purgeable}, false)"
            " AS purgeable, t.created_at > ? AS inside"
            " FROM tasks t LEFT JOIN outbox o ON o.task_id = t.task_id"
            f" WHERE t.{d.rowid} > ? ORDER BY t.{d.rowid} LIMIT ?",
            (*rule, cutoff, after, SCAN_ROWS),
        ).fetchall()
        answers = [
            r["reply_id"]
            for r in c.execute(
                f"SELECT reply_id FROM outbox{d.indexed_by('outbox_answers')} WHERE task_id IS NULL"
                " AND created_at <= ? AND state = 'sent' AND sent_at <= ?"
                " ORDER BY created_at LIMIT ?",
                (cutoff, cutoff, limit),
            ).fetchall()
        ]
    found: list[str] = []
    cursor, more = after, len(rows) == SCAN_ROWS
    for row in rows:
        if row["inside"]:  # accepted inside the window: so is everything after it
            more = False
            break
        cursor = row["seq"]
        if row["purgeable"]:
            found.append(row["task_id"])
            if len(found) >= limit:
                more = True
                break
    more = more or len(answers) >= limit
    if not found and not answers:
        return PurgeBatch(after=cursor, more=more)
    with _purging(db) as c:
        held = timed_lock()
        confirmed: list[Any] = []
        for chunk, marks in in_lists(found):
            confirmed += c.execute(
                "SELECT t.task_id, t.principal, t.message_id FROM tasks t"
                f" JOIN outbox o ON o.task_id = t.task_id WHERE t.task_id IN ({marks})"
                f" AND {purgeable}{c.dialect.skip_locked}",
                (*chunk, *rule),
            ).fetchall()
        ids = [r["task_id"] for r in confirmed]
        records = (
            c.executemany(
                "DELETE FROM inbox WHERE principal = ? AND message_id = ? AND task_id = ?",
                [(r["principal"], r["message_id"], r["task_id"]) for r in confirmed],
            ).rowcount
            if confirmed
            else 0
        )
        replies = 0
        for chunk, marks in in_lists(ids):
            replies += c.execute(f"DELETE FROM outbox WHERE task_id IN ({marks})", chunk).rowcount
            for table in _EFFECT_RECORDS:  # the task's effect records go with it
                c.execute(f"DELETE FROM {table} WHERE task_id IN ({marks})", chunk)
            c.execute(f"DELETE FROM tasks WHERE task_id IN ({marks})", chunk)
        if ids:  # approvals expired or revoked before the window: nothing can use them
            c.execute(
                "DELETE FROM approvals WHERE expires_at <= ? OR revoked_at <= ?", (cutoff, cutoff)
            )
            # A chain none of whose tasks was stored within the window is forgotten.
            c.execute("DELETE FROM chains WHERE updated_at <= ?", (cutoff,))
        for chunk, marks in in_lists(answers):
            replies += c.execute(
                f"DELETE FROM outbox WHERE reply_id IN ({marks}) AND task_id IS NULL"
                " AND state = 'sent' AND sent_at <= ?",
                (*chunk, cutoff),
            ).rowcount
        work = held()
    return PurgeBatch(len(ids), records, replies, 0, cursor, more, held(), work)


#: A task's effect records (schema migrations 7 and 10), purged with it.
_EFFECT_RECORDS = ("reconcile_log", "compensations", "approval_waits", "approval_releases")


def _purging(db: Db) -> AbstractContextManager[Conn]:
    """The deleting transaction. Children go first, then the task, so the foreign keys
    hold by construction: SQLite's check of each deleted task would scan the inbox, which
    has no index on ``task_id`` there, so it is turned off for the transaction;
    PostgreSQL checks by its index ``inbox_task``."""
    if isinstance(db, Database):
        return db.write("purge", foreign_keys=False)
    return db.write("purge")


def purge_receipts(db: Db, cutoff: float, after: int = 0, limit: int = PURGE_BATCH) -> PurgeBatch:
    """Delete at most ``limit`` receipts applied at or before ``cutoff`` whose row comes
    after cursor ``after`` (``Dialect.rowid``), oldest first, in one transaction (a receipt
    never changes once written: the read's choice holds)."""
    seq = db.dialect.rowid
    with db.read() as c:
        rows = c.execute(
            f"SELECT {seq} AS seq, received_at > ? AS inside FROM receipts WHERE {seq} > ?"
            f" ORDER BY {seq} LIMIT ?",
            (cutoff, after, limit),
        ).fetchall()
    found: list[int] = []
    cursor, more = after, len(rows) == limit
    for row in rows:
        if row["inside"]:
            more = False
            break
        cursor = row["seq"]
        found.append(row["seq"])
    if not found:
        return PurgeBatch(after=cursor, more=more)
    with db.write("purge") as c:
        held = timed_lock()
        removed = 0
        for chunk, marks in in_lists(found):
            removed += c.execute(
                f"DELETE FROM receipts WHERE {seq} IN ({marks}) AND received_at <= ?",
                (*chunk, cutoff),
            ).rowcount
        work = held()
    return PurgeBatch(receipts=removed, after=cursor, more=more, lock_s=held(), work_s=work)


@dataclass(frozen=True)
class PurgeBatch:
    """What one purge transaction did.

    Attributes:
        requests: tasks deleted (each with its reply, and its inbox record if it held it).
        records: inbox records deleted.
        replies: outbox rows deleted (terminal replies and conflict answers).
        receipts: receipts deleted (the receiver's batches).
        after: the cursor for the next batch of the pass.
        more: whether the pass has more to look at (call again, after the pause).
        lock_s: how long the transaction held the write lock, its COMMIT (the WAL's
            fsync) included; 0 when none was needed.
        work_s: the part of ``lock_s`` before the COMMIT: the purge's own statements.
    """

    requests: int = 0
    records: int = 0
    replies: int = 0
    receipts: int = 0
    after: int = 0
    more: bool = False
    lock_s: float = 0.0
    work_s: float = 0.0

    @property
    def removed(self) -> int:
        return self.requests + self.replies + self.receipts


@dataclass
class PassStats:
    """A pass's totals and its transaction times (for the log line)."""

    requests: int = 0
    records: int = 0
    replies: int = 0
    receipts: int = 0
    lock_ms: list[float] = field(default_factory=list)
    work_ms: list[float] = field(default_factory=list)

    def add(self, batch: PurgeBatch) -> None:
        self.requests += batch.requests
        self.records += batch.records
        self.replies += batch.replies
        self.receipts += batch.receipts
        if batch.lock_s > 0:
            self.lock_ms.append(batch.lock_s * 1000)
            self.work_ms.append(batch.work_s * 1000)

    @property
    def removed(self) -> int:
        return self.requests + self.replies + self.receipts

    def summary(self) -> str:
        """One log line: the counts, and the write lock's time per transaction as
        p50/p99/max in ms, COMMIT included ("held") and before it ("work")."""
        held, work = sorted(self.lock_ms), sorted(self.work_ms)
        return (
            f"{self.requests} requests ({self.records} inbox records, {self.replies} replies),"
            f" {self.receipts} receipts in {len(held)} transactions;"
            f" write lock held {_quantiles(held)} ms, work {_quantiles(work)} ms"
        )


def _quantiles(sorted_ms: list[float]) -> str:
    top = sorted_ms[-1] if sorted_ms else 0.0
    return (
        f"p50 {percentile(sorted_ms, 0.50):.2f} p99 {percentile(sorted_ms, 0.99):.2f} max {top:.2f}"
    )


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of already sorted values; 0 for none."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


class PurgeSchedule:
    """When the next purge batch is due, on ``clock``: right after a batch that left more
    to do (after ``pause_s``, or ``PURGE_PAUSE_FACTOR`` times the batch's lock time if
    longer), ``every_s`` after the one that finished a pass. The first is due at once.
    Times are on ``clock``; the pauses are measured in seconds of ``lock_s``.

    ``cursor`` is where the pass goes on (``PurgeBatch.after``); 0 starts a new pass.
    """

    def __init__(
        self,
        clock: Clock,
        log: logging.Logger,
        every_s: float = PURGE_EVERY_S,
        pause_s: float = PURGE_PAUSE_S,
        pause_factor: float = PURGE_PAUSE_FACTOR,
    ) -> None:
        self.clock = clock
        self.log = log
        self.every_s = every_s
        self.pause_s = pause_s
        self.pause_factor = pause_factor
        self.cursor = 0
        self.stats = PassStats()
        self._due = float("-inf")

    def due(self) -> bool:
        return self.clock.now() >= self._due

    def wait_s(self) -> float:
        """Seconds until the next batch is due (0 when it is)."""
        return max(0.0, self._due - self.clock.now())

    def done(self, batch: PurgeBatch) -> PassStats | None:
        """Record a batch; returns the pass's totals when it ended the pass."""
        self.stats.add(batch)
        now = self.clock.now()
        if batch.more:
            self.cursor = batch.after
            self._due = now + max(self.pause_s, self.pause_factor * batch.lock_s)
            return None
        finished, self.stats, self.cursor = self.stats, PassStats(), 0
        self._due = now + self.every_s
        return finished

    def failed(self) -> None:
        """A batch failed (busy, Redis away): try again a whole interval later."""
        self._due = self.clock.now() + self.every_s

    def run_batch(self, purge: Callable[[int], PurgeBatch]) -> None:
        """Run the due batch, ``purge(cursor)``, and schedule the next. A batch that fails
        (the lock busy past the timeout, a disk error, Redis away) is logged and tried again
        an interval later: the purge never stops the process. Each pass that removed
        something is logged with its transaction times."""
        try:
            batch = purge(self.cursor)
        except BrokerAdapterError as exc:
            self.log.warning("purge failed, will retry in %g s: %s", self.every_s, exc)
            self.failed()
            return
        finished = self.done(batch)
        if finished is not None and finished.removed:
            self.log.info("purged %s", finished.summary())

    def run_for(self, purge: Callable[[int], PurgeBatch], budget_s: float) -> None:
        """Run due batches one after the other for about ``budget_s`` at most (the last one
        may end past it): for a loop that purges between its own steps, where no pause is
        needed (``pause_s`` 0) but a step must not wait long."""
        give_up = time.monotonic() + budget_s
        while self.due():
            self.run_batch(purge)
            if time.monotonic() >= give_up:
                return


def run_purges(
    stop: threading.Event, purge: Callable[[int], PurgeBatch], schedule: PurgeSchedule
) -> None:
    """The purge loop of a thread of its own (the runner's): a batch whenever ``schedule``
    says one is due (``PurgeSchedule.run_batch``), until ``stop``."""
    while not stop.wait(schedule.wait_s()):
        schedule.run_batch(purge)


def whole_pass(batch: Callable[[int], PurgeBatch]) -> PassStats:
    """Run a purge pass without pauses: ``batch(after)`` until it leaves nothing more."""
    stats, after = PassStats(), 0
    while True:
        done = batch(after)
        stats.add(done)
        if not done.more:
            return stats
        after = done.after


def timed_lock() -> Callable[[], float]:
    """A stopwatch started now: call it for the seconds since."""
    start = time.perf_counter()
    return lambda: time.perf_counter() - start
