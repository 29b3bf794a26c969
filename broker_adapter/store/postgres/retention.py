"""Retention on PostgreSQL: ``store.retention``'s rule, a small batch per transaction.

A request goes as a whole (task, its inbox record if it still names this task, its
terminal reply) once its task is terminal with its deadline passed, it was accepted
``retention_s`` ago and its reply was sent ``retention_s`` ago; conflict answers go once
sent past the window; receipts once applied past it. Candidates are read outside the
writing transaction, walking ``tasks.seq`` (``receipts.seq``) oldest first from the pass's
cursor; the deleting transaction takes each candidate's row lock with the rule re-checked
(``FOR UPDATE SKIP LOCKED``: a row another transaction holds is left for the next pass)
and deletes at most ``PURGE_BATCH`` requests, so no transaction holds many locks long.
PostgreSQL's autovacuum reclaims the deleted rows' space for new ones.
"""

from __future__ import annotations

from broker_adapter.store.postgres.db import PgDatabase
from broker_adapter.store.retention import (
    _EFFECT_RECORDS,
    PURGE_BATCH,
    SCAN_ROWS,
    PurgeBatch,
    timed_lock,
)

_TERMINAL = "('done', 'failed', 'cancelled', 'expired', 'hop_limit')"
#: The rule of a purgeable request on ``tasks t`` joined with its reply ``outbox o``;
#: parameters ``(now, cutoff, cutoff)``.
PURGEABLE_SQL = (
    f"t.state IN {_TERMINAL} AND t.deadline <= %s AND t.created_at <= %s"
    " AND o.state = 'sent' AND o.sent_at <= %s"
)


def purge_requests(
    db: PgDatabase, now: float, retention_s: float, after: int = 0, limit: int = PURGE_BATCH
) -> PurgeBatch:
    """Delete at most ``limit`` purgeable requests after cursor ``after`` (``tasks.seq``)
    and up to ``limit`` conflict answers past the window, in one transaction."""
    cutoff = now - retention_s
    rule = (now, cutoff, cutoff)
    with db.read() as c:
        rows = c.execute(
            "SELECT t.seq, t.task_id, coalesce("
            + PURGEABLE_SQL
            + ", false) AS purgeable, t.created_at > %s AS inside"
            " FROM tasks t LEFT JOIN outbox o ON o.task_id = t.task_id"
            " WHERE t.seq > %s ORDER BY t.seq LIMIT %s",
            (*rule, cutoff, after, SCAN_ROWS),
        ).fetchall()
        answers = [
            r["reply_id"]
            for r in c.execute(
                "SELECT reply_id FROM outbox WHERE task_id IS NULL AND created_at <= %s"
                " AND state = 'sent' AND sent_at <= %s ORDER BY created_at LIMIT %s",
                (cutoff, cutoff, limit),
            )
        ]
    found: list[str] = []
    cursor, more = after, len(rows) == SCAN_ROWS
    for row in rows:
        if row["inside"]:
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
    with db.write("purge") as c:
        held = timed_lock()
        confirmed = c.execute(
            "SELECT t.task_id, t.principal, t.message_id FROM tasks t"
            " JOIN outbox o ON o.task_id = t.task_id WHERE t.task_id = ANY(%s)"
            f" AND {PURGEABLE_SQL} FOR UPDATE OF t, o SKIP LOCKED",
            (found, *rule),
        ).fetchall()
        ids = [r["task_id"] for r in confirmed]
        records = c.execute(
            "DELETE FROM inbox i USING unnest(%s::text[], %s::text[], %s::text[])"
            " AS gone(principal, message_id, task_id) WHERE i.principal = gone.principal"
            " AND i.message_id = gone.message_id AND i.task_id = gone.task_id",
            ([r["principal"] for r in confirmed], [r["message_id"] for r in confirmed], ids),
        ).rowcount
        replies = c.execute("DELETE FROM outbox WHERE task_id = ANY(%s)", (ids,)).rowcount
        for table in _EFFECT_RECORDS:  # the task's effect records go with it
            c.execute(f"DELETE FROM {table} WHERE task_id = ANY(%s)", (ids,))
        c.execute("DELETE FROM tasks WHERE task_id = ANY(%s)", (ids,))
        if ids:  # approvals expired or revoked before the window: nothing can use them
            c.execute(
                "DELETE FROM approvals WHERE expires_at <= %s OR revoked_at <= %s",
                (cutoff, cutoff),
            )
            # A chain none of whose tasks was stored within the window is forgotten.
            c.execute("DELETE FROM chains WHERE updated_at <= %s", (cutoff,))
        replies += c.execute(
            "DELETE FROM outbox WHERE reply_id = ANY(%s) AND task_id IS NULL"
            " AND state = 'sent' AND sent_at <= %s",
            (answers, cutoff),
        ).rowcount
        work = held()
    return PurgeBatch(len(ids), records, replies, 0, cursor, more, held(), work)


def purge_receipts(
    db: PgDatabase, cutoff: float, after: int = 0, limit: int = PURGE_BATCH
) -> PurgeBatch:
    """Delete at most ``limit`` receipts applied at or before ``cutoff`` after cursor
    ``after`` (``receipts.seq``), oldest first, in one transaction."""
    with db.read() as c:
        rows = c.execute(
            "SELECT seq, received_at > %s AS inside FROM receipts WHERE seq > %s"
            " ORDER BY seq LIMIT %s",
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
        removed = c.execute(
            "DELETE FROM receipts WHERE seq = ANY(%s) AND received_at <= %s", (found, cutoff)
        ).rowcount
        work = held()
    return PurgeBatch(receipts=removed, after=cursor, more=more, lock_s=held(), work_s=work)
