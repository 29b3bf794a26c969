"""``store.report.snapshot`` on PostgreSQL: the same counts, from one read-only transaction
(REPEATABLE READ, so that all of them see one moment, as SQLite's read does)."""

from __future__ import annotations

from typing import Any

from broker_adapter.store.approvals import approval_counts
from broker_adapter.store.effects import effect_counts
from broker_adapter.store.postgres.db import PgDatabase
from broker_adapter.store.report import TERMINAL_NAMES, shape


def snapshot(db: PgDatabase, now: float) -> dict[str, Any]:
    """The four stages, counted (see ``store.report.snapshot``)."""
    with db.read() as c:
        c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        inbox = c.execute(
            "SELECT count(*) AS n, coalesce(sum(duplicates), 0) AS d,"
            " coalesce(sum(conflicts), 0) AS c FROM inbox"
        ).fetchone()
        states = {
            r["state"]: r["n"]
            for r in c.execute("SELECT state, count(*) AS n FROM tasks GROUP BY state")
        }
        leases = c.execute(
            "SELECT count(*) FILTER (WHERE lease_until > %s) AS live,"
            " count(*) FILTER (WHERE lease_until <= %s) AS expired"
            " FROM tasks WHERE state = 'running'",
            (now, now),
        ).fetchone()
        ready = c.execute(
            "SELECT count(*) AS n FROM tasks WHERE state = 'pending' AND not_before <= %s",
            (now,),
        ).fetchone()
        outbox = {
            r["state"]: r["n"]
            for r in c.execute("SELECT state, count(*) AS n FROM outbox GROUP BY state")
        }
        oldest = c.execute(
            "SELECT min(created_at) AS t FROM outbox WHERE state IN ('pending', 'sending')"
        ).fetchone()
        receipts = c.execute(
            "SELECT count(*) AS n, coalesce(sum(effects), 0) AS e FROM receipts"
        ).fetchone()
        effects = {**effect_counts(c), **approval_counts(c, now)}
    # Aggregates without GROUP BY: one row each, always.
    assert inbox and leases and ready and oldest and receipts  # noqa: PT018
    return shape(
        now, (inbox["n"], int(inbox["d"]), int(inbox["c"])), states,
        (leases["live"], leases["expired"]), ready["n"], outbox, oldest["t"],
        (receipts["n"], int(receipts["e"])), effects,
    )  # fmt: skip


__all__ = ["TERMINAL_NAMES", "snapshot"]
