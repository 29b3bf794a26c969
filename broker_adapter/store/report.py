"""Read-only snapshots of the database for ``status`` and monitoring (no writes)."""

from __future__ import annotations

from typing import Any

from broker_adapter.store.approvals import approval_counts
from broker_adapter.store.db import Database
from broker_adapter.store.effects import effect_counts


def snapshot(db: Database, now: float) -> dict[str, Any]:
    """The four stages, counted from one consistent read.

    Returns:
        ``received`` (inbox), ``processing`` (pending/running and leases), ``terminal``
        (tasks by terminal state), ``delivery`` (outbox by state, oldest unsent age) and
        ``effects`` (unknown outcomes, reconciles, compensations, approvals:
        ``effects.effect_counts``, ``approvals.approval_counts``).
    """
    with db.read() as c:
        inbox = c.execute(
            "SELECT count(*), coalesce(sum(duplicates), 0), coalesce(sum(conflicts), 0) FROM inbox"
        ).fetchone()
        states = dict(c.execute("SELECT state, count(*) FROM tasks GROUP BY state").fetchall())
        leases = c.execute(
            "SELECT coalesce(sum(lease_until > ?), 0), coalesce(sum(lease_until <= ?), 0)"
            " FROM tasks WHERE state = 'running'",
            (now, now),
        ).fetchone()
        ready = c.execute(
            "SELECT count(*) FROM tasks WHERE state = 'pending' AND not_before <= ?", (now,)
        ).fetchone()[0]
        outbox = dict(c.execute("SELECT state, count(*) FROM outbox GROUP BY state").fetchall())
        oldest = c.execute(
            "SELECT min(created_at) FROM outbox WHERE state IN ('pending', 'sending')"
        ).fetchone()[0]
        receipts = c.execute("SELECT count(*), coalesce(sum(effects), 0) FROM receipts").fetchone()
        effects = {**effect_counts(c), **approval_counts(c, now)}
    return shape(
        now, tuple(inbox), states, tuple(leases), ready, outbox, oldest, tuple(receipts), effects
    )


#: The terminal states ``snapshot`` counts under ``terminal``.
TERMINAL_NAMES = ("done", "failed", "cancelled", "expired", "hop_limit")


def shape(
    now: float, inbox: tuple[Any, ...], states: dict[str, int], leases: tuple[Any, ...],
    ready: int, outbox: dict[str, int], oldest: float | None, receipts: tuple[Any, ...],
    effects: dict[str, int],
) -> dict[str, Any]:  # fmt: skip
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
            **{s: outbox.get(s, 0) for s in ("pending", "sending", "sent", "dead")},
            "oldest_unsent_age_s": None if oldest is None else round(max(0.0, now - oldest), 3),
        },
        "receipts": {"replies": receipts[0], "effects": receipts[1]},
        "effects": effects,
    }
