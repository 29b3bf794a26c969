"""Counters that never fall: the ``counters`` table (schema migration 10 on SQLite, 3 on
PostgreSQL), which the purge (``retention``) never touches.

A count derived from rows (reconciles from ``reconcile_log``, compensations from
``compensations``) falls when the purge forgets those rows past the retention window, and
Prometheus reads a counter that falls as a restart. A count kept in a worker's memory is
lost with the worker: the attempt of a worker killed mid-handler, the one that may have
applied its effect, would be counted nowhere. So the counts an operator alerts on are added
here, by ``count_in``, inside the very transaction that makes the event durable (the
claim's for an attempt, the take-back's or the holder's for a task that goes ``unknown``,
the reconcile's for its record): the count commits with the event, or neither does.

Rows are ``(name, slot, value)``; a counter's value is the sum over its slots. On
PostgreSQL each session adds to its own row (the slot is its ``pg_backend_pid()``): two
transactions in progress are two sessions, so a claim never waits on another host's
claim for a counter's row lock (the claims skip each other's rows, ``skip_locked``, and
must not meet here either). The rows are few (one per counter and server process id,
reused as ids are); SQLite has one writer at a time and uses slot 0. A counter is
database-wide: every adapter sharing the database reports the same value (aggregate them
with ``max``, not ``sum``).
"""

from __future__ import annotations

from typing import Final

from broker_adapter.store.sql import Conn

#: Task attempts, counted when the claim commits (attempts + 1).
TASK_ATTEMPTS: Final = "task_attempts"
#: Durable transitions to ``unknown``: a holder's (``EffectsStore.to_unknown``), the lease
#: take-back's (``housekeeping.unknown_from_lapsed_in``) and a cancel's.
TASK_UNKNOWN: Final = "task_outcomes_unknown"
#: Reconcile records by outcome: ``reconciled_done``, ``reconciled_not-done``,
#: ``reconciled_unknown``.
RECONCILED: Final = "reconciled_"
#: Compensations begun (``compensations_started``) and ended (``_done``, ``_failed``).
COMPENSATIONS: Final = "compensations_"
#: Operator waits past ``ReconcilePolicy.operator_timeout_s``, by the action taken:
#: ``operator_timeouts_alert``, ``operator_timeouts_fail``.
OPERATOR_TIMEOUTS: Final = "operator_timeouts_"

_UPSERT = (
    "INSERT INTO counters (name, slot, value) VALUES (?, {slot}, ?)"
    " ON CONFLICT (name, slot) DO UPDATE SET value = counters.value + excluded.value"
)
_SLOT = {"sqlite": "0", "postgresql": "pg_backend_pid()"}


def count_in(c: Conn, name: str, n: int = 1) -> None:
    """Add ``n`` to counter ``name`` inside the caller's transaction (nothing for
    ``n`` <= 0: a counter never falls)."""
    if n <= 0:
        return
    c.execute(_UPSERT.format(slot=_SLOT[c.dialect.name]), (name, n))


def read_counters(c: Conn) -> dict[str, int]:
    """Every counter's value (the sum of its slots), in the caller's read transaction."""
    rows = c.execute("SELECT name, sum(value) AS n FROM counters GROUP BY name").fetchall()
    return {r["name"]: int(r["n"]) for r in rows}


#: The counters ``monotonic_counts`` always reports (0 until first counted).
KNOWN: Final = (
    TASK_ATTEMPTS,
    TASK_UNKNOWN,
    *(RECONCILED + o for o in ("done", "not-done", "unknown")),
    *(COMPENSATIONS + o for o in ("started", "done", "failed")),
    *(OPERATOR_TIMEOUTS + a for a in ("alert", "fail")),
)


def monotonic_counts(c: Conn) -> dict[str, int]:
    """``read_counters`` with every ``KNOWN`` counter present."""
    return {**dict.fromkeys(KNOWN, 0), **read_counters(c)}
