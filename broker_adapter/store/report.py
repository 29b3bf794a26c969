"""Read-only snapshots of the database for ``status`` and monitoring (no writes), one text
for both stores (``store.sql``): counts read by column name, from one read transaction
that sees one moment (SQLite's read snapshot; PostgreSQL's REPEATABLE READ)."""

from __future__ import annotations

from typing import Any

from broker_adapter.store.approvals import approval_counts
from broker_adapter.store.effects import effect_counts
from broker_adapter.store.operator_waits import outcome_gauges
from broker_adapter.store.outbox_types import OUTBOX_STATES
from broker_adapter.store.sql import Conn, Db
from broker_adapter.store.task_types import LIVE_STATES, TERMINAL_STATES, TaskState


def snapshot(db: Db, now: float) -> dict[str, Any]:
    """The four stages, counted from one consistent read.

    Returns:
        ``received`` (inbox), ``processing`` (pending/running and leases), ``terminal``
        (tasks by terminal state), ``delivery`` (outbox by state, oldest unsent age) and
        ``effects`` (unknown outcomes, reconciles, compensations: ``effects.effect_counts``;
        approvals: ``approvals.approval_counts``).
    """
    with db.read() as c:
        if c.dialect.name == "postgresql":  # first in the transaction: all counts, one moment
            c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        inbox = c.execute(
            "SELECT count(*) AS n, coalesce(sum(duplicates), 0) AS d,"
            " coalesce(sum(conflicts), 0) AS c FROM inbox"
        ).fetchone()
        states = _by(c, "SELECT state AS k, count(*) AS n FROM tasks GROUP BY state")
        leases = c.execute(
            "SELECT count(*) FILTER (WHERE lease_until > ?) AS live,"
            " count(*) FILTER (WHERE lease_until <= ?) AS expired"
            " FROM tasks WHERE state = 'running'",
            (now, now),
        ).fetchone()
        ready = c.execute(
            "SELECT count(*) AS n FROM tasks WHERE state = 'pending' AND not_before <= ?", (now,)
        ).fetchone()
        outbox = _by(c, "SELECT state AS k, count(*) AS n FROM outbox GROUP BY state")
        oldest = c.execute(
            "SELECT min(created_at) AS t FROM outbox WHERE state IN ('pending', 'sending')"
        ).fetchone()
        receipts = c.execute(
            "SELECT count(*) AS n, coalesce(sum(effects), 0) AS e FROM receipts"
        ).fetchone()
        effects = {**effect_counts(c), **approval_counts(c, now), **outcome_gauges(c, now)}
    return shape(
        now,
        (inbox["n"], int(inbox["d"]), int(inbox["c"])),
        states,
        (leases["live"], leases["expired"]),
        ready["n"],
        outbox,
        oldest["t"],
        (receipts["n"], int(receipts["e"])),
        effects,
    )


def task_counts(db: Db) -> dict[str, dict[str, int]]:
    """Tasks by name (the envelope's ``task``; ``""`` for none) and state; empty while no
    task was sent with a name."""
    with db.read() as c:
        rows = c.execute(
            "SELECT coalesce(task_name, '') AS name, state, count(*) AS n FROM tasks"
            " GROUP BY task_name, state"
        ).fetchall()
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        out.setdefault(r["name"], {})[r["state"]] = r["n"]
    return out if any(out) else {}


def _by(c: Conn, sql: str) -> dict[str, int]:
    """A ``SELECT k, n ... GROUP BY`` as a dict."""
    return {r["k"]: r["n"] for r in c.execute(sql).fetchall()}


#: The terminal states ``snapshot`` counts under ``terminal``, in ``TaskState``'s order.
TERMINAL_NAMES = tuple(s.value for s in TaskState if s in TERMINAL_STATES)
#: The live states (``snapshot`` counts each under ``processing``), in ``TaskState``'s order.
LIVE_NAMES = tuple(s.value for s in TaskState if s in LIVE_STATES)


def shape(
    now: float,
    inbox: tuple[Any, ...],
    states: dict[str, int],
    leases: tuple[Any, ...],
    ready: int,
    outbox: dict[str, int],
    oldest: float | None,
    receipts: tuple[Any, ...],
    effects: dict[str, float],
) -> dict[str, Any]:
    """The snapshot's dict from its counts (one shape for every backend): ``inbox`` is
    (records, duplicates, conflicts), ``leases`` (live, expired), ``receipts`` (replies,
    effects), ``effects`` the effect and approval counts."""
    return {
        "received": {"inbox": inbox[0], "duplicates": inbox[1], "conflicts": inbox[2]},
        "processing": {
            "pending": states.get("pending", 0),
            "ready": ready,
            "running": states.get("running", 0),
            "live_leases": leases[0],
            "expired_leases": leases[1],
            "unknown": states.get("unknown", 0),
            "waiting_approval": states.get("waiting_approval", 0),
        },
        "terminal": {name: states.get(name, 0) for name in TERMINAL_NAMES},
        "delivery": {
            **{s: outbox.get(s, 0) for s in OUTBOX_STATES},
            "oldest_unsent_age_s": None if oldest is None else round(max(0.0, now - oldest), 3),
        },
        "receipts": {"replies": receipts[0], "effects": receipts[1]},
        "effects": effects,
    }
