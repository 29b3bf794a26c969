"""The task states' arrows (the states: ``task_types.TaskState``), and the one way into a
terminal state: with the task's one reply.

::

    accept ──> pending ──claim──> running ──done──> done
                  ^                  │ ──failure(retryable, budget left)──> pending (backoff)
                  └──lease expired───┤ ──failure / budget spent──> failed
                                     │ ──deadline reached──> expired
               cancel (any live) ────┴──> cancelled          hops > limit at accept ──> hop_limit
    running ──effect started, then timeout / lost lease──> unknown ──reconcile──> done |
                                                              pending | failed | expired
    running ──no valid approval──> waiting_approval ──approval──> pending
                                                    ──approval timeout──> failed
    (``effects.py``, ``approvals.py``)

Every arrow into a terminal state (``to_terminal``; an accept that stores a task terminal
at once writes only its reply, ``write_reply``) writes the task's reply into the outbox in
the same transaction. The unique index on the outbox's ``task_id`` makes a second terminal
reply impossible. Both stores run these functions (``store.sql``: portable SQL on the
caller's ``Conn``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker_adapter.errors import StaleError
from broker_adapter.protocol.reply import encode_body, reply_id_for, terminal_body
from broker_adapter.store.outbox_types import PublisherClaim, ReplySpec
from broker_adapter.store.outbox_writes import enqueue_many
from broker_adapter.store.sql import Conn
from broker_adapter.store.task_types import TaskState

#: What a reply body takes from the task row besides the outcome: principal, message id,
#: correlation id, attempts, fence.
ReplyKey = tuple[str, str, str | None, int, int]


def reply_key(row: Any) -> ReplyKey:
    """The ``ReplyKey`` of a task row."""
    return (
        row["principal"],
        row["message_id"],
        row["correlation_id"],
        row["attempts"],
        row["fence"],
    )


def write_reply(
    c: Conn,
    task_id: str,
    state: TaskState,
    result: str | None,
    error: str | None,
    now: float,
    t: Any = None,
    encoded: tuple[bytes, str] | None = None,
    claim: PublisherClaim | None = None,
    effects: Mapping[str, Any] | None = None,
) -> str:
    """Write the terminal reply of ``task_id`` into the outbox (the caller's transaction).

    Args:
        t: the task's ``principal``, ``message_id``, ``correlation_id``, ``attempts``,
            ``fence`` and ``traceparent`` (a row or a mapping), if already read in this
            transaction (spares a lookup).
        encoded: the body from ``encode_body``, if built before the transaction from them.
        claim: write the reply already claimed by that publisher (``enqueue_many``).

    Returns:
        the reply id.
    """
    if t is None:
        t = c.execute(
            "SELECT principal, message_id, correlation_id, attempts, fence, traceparent"
            " FROM tasks WHERE task_id = ?",
            (task_id,),
        ).fetchone()
        assert t is not None
    spec = reply_spec(task_id, state, result, error, now, t, encoded, effects)
    if enqueue_many(c, [spec], now, claim) != 1:
        # the unique index makes this unreachable unless a bug re-terminates
        raise StaleError(task_id, "already_terminal", "a terminal reply already exists")
    return spec[0]


def reply_spec(
    task_id: str,
    state: TaskState,
    result: str | None,
    error: str | None,
    now: float,
    t: Any,
    encoded: tuple[bytes, str] | None = None,
    effects: Mapping[str, Any] | None = None,
) -> ReplySpec:
    """The outbox row of ``task_id``'s terminal reply (``outbox_writes.enqueue_many``), from the
    task's ``t`` (``write_reply``); ``encoded``: its body if built already."""
    if encoded is None:
        encoded = encode_body(
            terminal_body(
                task_id,
                state.value,
                t["principal"],
                t["message_id"],
                t["correlation_id"],
                result,
                error,
                t["attempts"],
                t["fence"],
                now,
                traceparent=t["traceparent"],
                effects=effects,
            )
        )
    data, content_hash = encoded
    return (
        reply_id_for(task_id),
        task_id,
        t["principal"],
        t["message_id"],
        state.value,
        data,
        content_hash,
    )


def to_terminal(
    c: Conn,
    task_id: str,
    state: TaskState,
    now: float,
    *,
    result: str | None = None,
    error: str | None = None,
    row: Any = None,
    encoded: tuple[bytes, str] | None = None,
    claim: PublisherClaim | None = None,
    effects: Mapping[str, Any] | None = None,
) -> str:
    """Make a task terminal and write its reply (``write_reply``; ``row`` is its ``t``)."""
    c.execute(
        "UPDATE tasks SET state = ?, owner = NULL, lease_until = NULL, updated_at = ?,"
        " finished_at = ?, result = ?, error = ? WHERE task_id = ?",
        (state.value, now, now, result, c.dialect.text(error), task_id),
    )
    return write_reply(c, task_id, state, result, error, now, row, encoded, claim, effects)
