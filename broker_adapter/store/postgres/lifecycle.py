"""The one way into a terminal state on PostgreSQL: with the task's one reply, in the
same transaction (``store.lifecycle``'s rule; the outbox's unique index on ``task_id``
makes a second terminal reply impossible here too), and the housekeeping that applies the
clock (``store.housekeeping``'s rule) before every claim."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker_adapter.errors import StaleError
from broker_adapter.protocol.reply import encode_body, reply_id_for, terminal_body
from broker_adapter.store.lifecycle import TaskState
from broker_adapter.store.outbox import PublisherClaim
from broker_adapter.store.postgres.db import Conn, free_text
from broker_adapter.store.postgres.outbox import enqueue_encoded
from broker_adapter.store.transitions import Reconciled


def write_reply(
    c: Conn,
    task_id: str,
    state: TaskState,
    result: str | None,
    error: str | None,
    now: float,
    t: Mapping[str, Any] | None = None,
    encoded: tuple[bytes, str] | None = None,
    claim: PublisherClaim | None = None,
) -> str:
    """Write the terminal reply of ``task_id`` into the outbox (the caller's transaction);
    ``t``: the task's principal, message id, correlation id, attempts, fence and
    traceparent if read
    already; ``encoded``: the body if built before the transaction. Returns the reply id."""
    if t is None:
        t = c.execute(
            "SELECT principal, message_id, correlation_id, attempts, fence, traceparent"
            " FROM tasks WHERE task_id = %s",
            (task_id,),
        ).fetchone()
        assert t is not None
    reply_id = reply_id_for(task_id)
    if encoded is None:
        encoded = encode_body(
            terminal_body(task_id, state.value, t["principal"], t["message_id"],
                          t["correlation_id"], result, error, t["attempts"], t["fence"], now,
                          traceparent=t.get("traceparent"))
        )  # fmt: skip
    data, content_hash = encoded
    inserted = enqueue_encoded(
        c, reply_id=reply_id, task_id=task_id, principal=t["principal"],
        message_id=t["message_id"], status=state.value, data=data,
        content_hash=content_hash, now=now, claim=claim,
    )  # fmt: skip
    if not inserted:
        raise StaleError(task_id, "already_terminal", "a terminal reply already exists")
    return reply_id


def to_terminal(
    c: Conn,
    task_id: str,
    state: TaskState,
    now: float,
    *,
    result: str | None = None,
    error: str | None = None,
    row: Mapping[str, Any] | None = None,
    encoded: tuple[bytes, str] | None = None,
    claim: PublisherClaim | None = None,
) -> str:
    """Make a task terminal and write its reply (``write_reply``; ``row`` is its ``t``)."""
    c.execute(
        "UPDATE tasks SET state = %s, owner = NULL, lease_until = NULL, updated_at = %s,"
        " finished_at = %s, result = %s, error = %s WHERE task_id = %s",
        (state.value, now, now, result, free_text(error), task_id),
    )
    return write_reply(c, task_id, state, result, error, now, row, encoded, claim)


def reconcile_in(c: Conn, now: float, taken: list[Reconciled] | None = None) -> dict[str, int]:
    """Apply ``now`` in the caller's transaction: live tasks past their deadline end
    ``expired``; running tasks whose lease ran out go back to ``pending``, or end
    ``failed`` on their last attempt. Rows another transaction holds locked are skipped
    (``SKIP LOCKED``): that one is settling or reconciling them already, and the next
    claim sees them again.

    Returns:
        counts by what happened: ``expired``, ``requeued``, ``exhausted``; each task is
        added to ``taken`` (``transitions.reconciled`` logs them once the transaction
        committed).
    """
    counts = {"expired": 0, "requeued": 0, "exhausted": 0}
    for r in c.execute(
        "SELECT task_id FROM tasks WHERE state IN ('pending', 'running') AND deadline <= %s"
        " FOR UPDATE SKIP LOCKED",
        (now,),
    ).fetchall():
        to_terminal(c, r["task_id"], TaskState.EXPIRED, now, error="deadline reached")
        counts["expired"] += 1
        if taken is not None:
            taken.append((r["task_id"], "expired", "expired", None, None))
    for r in c.execute(
        "SELECT task_id, attempts, max_attempts, owner FROM tasks"
        " WHERE state = 'running' AND lease_until <= %s FOR UPDATE SKIP LOCKED",
        (now,),
    ).fetchall():
        if r["attempts"] >= r["max_attempts"]:
            to_terminal(
                c, r["task_id"], TaskState.FAILED, now,
                error=f"lease of {r['owner']} expired on the last attempt "
                f"({r['attempts']}/{r['max_attempts']})",
            )  # fmt: skip
            counts["exhausted"] += 1
            if taken is not None:
                taken.append((r["task_id"], "failed", "failed", r["owner"], r["attempts"]))
        else:
            c.execute(
                "UPDATE tasks SET state = 'pending', owner = NULL, lease_until = NULL,"
                " not_before = %s, error = %s, updated_at = %s WHERE task_id = %s",
                (now, f"lease of {r['owner']} expired", now, r["task_id"]),
            )
            counts["requeued"] += 1
            if taken is not None:
                taken.append((r["task_id"], "lease_expired", "pending", r["owner"], r["attempts"]))
    return counts
