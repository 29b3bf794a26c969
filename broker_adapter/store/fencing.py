"""The fencing rule (``docs/RULES.md`` rule 10), defined once for tasks and outbox rows,
and the claim that makes a holder (``claim_rows``, rule 9).

A worker holds a task, and a publisher holds a reply row, while the row is in its held
state (``running`` / ``sending``), names the holder as ``owner``, carries the holder's
``fence`` and its lease has not run out; a task is held only before its deadline, too.
Every fenced write checks exactly that, in one of two forms:

* in SQL (``TASK_HELD`` / ``REPLY_HELD``), as the WHERE clause of the write itself, one
  statement instead of a read and a write (``held_params`` gives the parameters);
* in Python (``fence_refusal``), on a row read in the transaction: which part of the rule fails,
  as the precise ``StaleError`` the caller raises or reports.

A write whose SQL form matched nothing asks ``fence_refusal`` why, on the row as it is.

Two named variants of the task rule leave terms out, each for steps that a holder owes
whatever the clock says (the worker bounds its handler by the deadline itself, and the
take-back of the clock ends what lapses):

* ``TASK_HELD_PAST_DEADLINE``: no deadline term. Recording that an effect starts
  (``EffectsStore.mark_effect_started``), giving up a task whose effect may have happened
  (``EffectsStore.to_unknown``: ``unknown`` outlives the deadline, which bounds new
  attempts, not finding out what one did) and parking a task for its approval
  (``ApprovalStore.wait_for_approval``: the wait has an end of its own). The reconcile
  of an ``unknown`` task is held the same way (``fence_refusal`` with ``deadline=False``).
* ``TASK_OWNED``: neither lease nor deadline. The holder that stopped on a requested
  cancel ends its task ``cancelled`` with what it knows happened
  (``EffectsStore.end_requested_cancel``); the lapsed lease of such a task would end it
  ``cancelled`` too (``housekeeping``), only without that account.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any, Final

from broker_adapter.errors import FencedError, StaleError, TaskCancelled
from broker_adapter.store.sql import Conn, marks
from broker_adapter.store.task_types import TaskState

#: The state a worker holds a task in, and a publisher a reply row in.
TASK_HELD_STATE: Final = TaskState.RUNNING.value
REPLY_HELD_STATE: Final = "sending"


def held_sql(state: str, *, deadline: bool, lease: bool = True) -> str:
    """The rule as a WHERE clause fragment (``store.sql``'s placeholders); parameters from
    ``held_params`` (with the same ``deadline`` and ``lease``)."""
    sql = f"fence = ? AND state = '{state}' AND owner = ?"
    if lease:
        sql += " AND lease_until > ?"
    return sql + " AND deadline > ?" if deadline else sql


#: Held by (fence, owner) at now: a task (deadline included) and a reply row.
TASK_HELD: Final = held_sql(TASK_HELD_STATE, deadline=True)
REPLY_HELD: Final = held_sql(REPLY_HELD_STATE, deadline=False)
#: A task held by (fence, owner) at now, whatever its deadline (see the module's text).
TASK_HELD_PAST_DEADLINE: Final = held_sql(TASK_HELD_STATE, deadline=False)
#: A running task whose claim is (fence, owner), whatever its lease and deadline (see the
#: module's text); no time parameter.
TASK_OWNED: Final = held_sql(TASK_HELD_STATE, deadline=False, lease=False)


def held_params(
    fence: int, owner: str, now: float, *, deadline: bool, lease: bool = True
) -> tuple[Any, ...]:
    """The parameters of ``held_sql`` / ``TASK_HELD`` / ``REPLY_HELD`` / ... in order."""
    if not lease:
        return (fence, owner)
    return (fence, owner, now, now) if deadline else (fence, owner, now)


#: Rows per statement of ``update_held`` (a few parameters each: within SQLite's limit on
#: bound parameters).
HELD_UPDATE_CHUNK: Final = 256


def update_held(
    c: Conn,
    template: str,
    rows: Mapping[tuple[int, str], Sequence[Sequence[Any]]],
    now: float,
    *,
    deadline: bool,
    before: Sequence[Any] = (),
) -> list[Any]:
    """A fenced batch write: ``template`` is an ``UPDATE ... FROM (VALUES {rows}) AS v``
    whose WHERE clause ends with the rule (``TASK_HELD`` / ``REPLY_HELD``); it runs once
    per holder ``(fence, owner)`` of ``rows`` and chunk of that holder's value rows, its
    parameters ``before`` (the SET clause's), the value rows, then the rule's at ``now``.
    A row whose holder no longer holds it is left alone. Returns what the statements
    returned (their ``RETURNING`` rows)."""
    out: list[Any] = []
    for (fence, owner), values in rows.items():
        for start in range(0, len(values), HELD_UPDATE_CHUNK):
            chunk = values[start : start + HELD_UPDATE_CHUNK]
            sql = template.format(rows=", ".join(f"({marks(len(v))})" for v in chunk))
            params = (
                *before,
                *(x for v in chunk for x in v),
                *held_params(fence, owner, now, deadline=deadline),
            )
            out.extend(c.execute(sql, params).fetchall())
    return out


def claim_rows(
    c: Conn, pick: str, pick_params: Sequence[Any], take: str, take_params: Sequence[Any], key: str
) -> list[Any]:
    """The claim idiom, for tasks, reply rows and ``unknown`` tasks alike: ``pick`` selects
    the keys (column ``key``) of the rows to take, in claim order, skipping those another
    transaction is taking (``dialect.skip_locked``: two claimers on two hosts never take one
    row and never wait on each other's); ``take`` is ONE ``UPDATE ... WHERE key IN ({ids})
    ... RETURNING`` over them (its parameters ``take_params``, then the keys), which sets the
    holder. RETURNING order is unspecified, so the rows come back in claim order; a row the
    UPDATE left alone is left out."""
    ids = [r[key] for r in c.execute(pick, tuple(pick_params)).fetchall()]
    if not ids:
        return []
    rows = c.execute(take.format(ids=marks(len(ids))), (*take_params, *ids)).fetchall()
    by_id = {r[key]: r for r in rows}
    return [by_id[i] for i in ids if i in by_id]


def fence_refusal(
    row: sqlite3.Row | Mapping[str, Any],
    key: str,
    owner: str,
    fence: int,
    now: float,
    *,
    state: str,
    deadline: bool,
) -> StaleError | None:
    """Why ``owner`` under ``fence`` may not act on ``row`` (the row ``key`` names) at
    ``now``, or None while it holds it. Checked in this order: the fence
    (``FencedError``), a cancelled task (``TaskCancelled``), the held ``state``
    (``not_<state>``), the owner, the lease (none is no lease) and, with ``deadline``,
    the deadline."""
    if row["fence"] != fence:
        return FencedError(key, fence, row["fence"])
    if row["state"] == TaskState.CANCELLED:
        return TaskCancelled(key)
    if row["state"] != state:
        return StaleError(key, f"not_{state}", f"state is {row['state']}")
    if row["owner"] != owner:
        return StaleError(key, "owner", f"held by {row['owner']}")
    if row["lease_until"] is None or row["lease_until"] <= now:
        return StaleError(key, "lease_expired")
    if deadline and row["deadline"] <= now:
        return StaleError(key, "deadline")
    return None
