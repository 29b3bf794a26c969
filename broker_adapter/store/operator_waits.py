"""Uncertain outcomes an operator sees and bounds: tasks waiting for an operator past
``ReconcilePolicy.operator_timeout_s``, the age gauges, and what ``broker-adapter reconcile
list`` and ``reconcile show`` print.

A task whose reconciles found nothing ``max_tries`` times waits for an operator
(``operator_since``). Past the bound (``bound_waits``, each reconcile pass), one of two
things happens, as configured:

* ``alert``: the task keeps waiting, marked ``operator_overdue_at`` (the
  ``ba_operator_waits_overdue`` gauge, the ``BrokerAdapterOperatorWaitOverdue`` alert);
* ``fail``: the task ends ``failed`` with its reply, whose ``effects.reconciled.outcome`` is
  ``unknown`` and whose error says so: nobody found out whether the effect happened. The
  fence is raised, so an operator's or a reconcile's later answer is refused.

Either way the pass counts it (``counters.OPERATOR_TIMEOUTS``) in its transaction and writes
a reconcile record (``unknown``, with the reason) for ``fail``. One short transaction per
pass, no call out of it; on PostgreSQL the rows another transaction holds are skipped
(``skip_locked``) for the next pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from broker_adapter.store.counters import OPERATOR_TIMEOUTS, count_in
from broker_adapter.store.effects import EffectsStore
from broker_adapter.store.lifecycle import to_terminal
from broker_adapter.store.reconcile_log import loads_or_none, log_reconcile, reply_member
from broker_adapter.store.sql import Conn
from broker_adapter.store.task_types import TaskState

OperatorTimeoutAction = Literal["alert", "fail"]
#: Tasks one ``bound_waits`` pass handles at most.
BOUND_BATCH = 100


@dataclass(frozen=True)
class WaitingTask:
    """An ``unknown`` task, as ``reconcile list`` shows it.

    Attributes:
        unknown_since: when its effect started (the outcome is uncertain since).
        operator_since: since when it waits for an operator (``None``: still reconciled).
        overdue: it waits past ``operator_timeout_s`` (the alert was raised).
        cancel_requested: a cancel waits for the reconcile (``EffectsStore.request_cancel``).
    """

    task_id: str
    principal: str
    message_id: str
    kind: str
    attempts: int
    reconcile_tries: int
    unknown_since: float | None
    operator_since: float | None
    overdue: bool
    cancel_requested: bool
    error: str | None
    effect_key_digest: str | None
    adapter_version: str | None


_WAITING_COLUMNS = (
    "task_id, principal, message_id, kind, attempts, reconcile_tries,"
    " coalesce(effect_started_at, updated_at) AS unknown_since, operator_since,"
    " coalesce(operator_overdue_at >= operator_since, false) AS overdue,"
    " cancel_requested_at IS NOT NULL AS cancel_requested, error, effect_key_digest,"
    " adapter_version"
)


class OperatorWaits:
    """The operator's view of uncertain outcomes on the database of ``effects``."""

    def __init__(self, effects: EffectsStore) -> None:
        self.effects = effects
        self.db = effects.db
        self.clock = effects.clock

    def bound_waits(
        self,
        timeout_s: float,
        action: OperatorTimeoutAction,
        by: str,
        limit: int = BOUND_BATCH,
    ) -> list[str]:
        """Apply ``action`` to the tasks that wait for an operator ``timeout_s`` or longer
        and were not bounded yet in this wait. Returns their task ids."""
        if action not in ("alert", "fail"):
            raise ValueError(f"operator timeout action must be alert or fail, got {action!r}")
        now = self.clock.now()
        with self.db.write("operator_timeout") as c:
            rows = c.execute(
                "SELECT task_id, fence, operator_since FROM tasks WHERE state = 'unknown'"
                " AND operator_since <= ? AND (operator_overdue_at IS NULL"
                " OR operator_overdue_at < operator_since) ORDER BY operator_since LIMIT ?"
                f"{c.dialect.skip_locked}",
                (now - timeout_s, limit),
            ).fetchall()
            for r in rows:
                waited = now - float(r["operator_since"])
                if action == "alert":
                    c.execute(
                        "UPDATE tasks SET operator_overdue_at = ? WHERE task_id = ?",
                        (now, r["task_id"]),
                    )
                else:
                    _fail_in(c, r["task_id"], int(r["fence"]) + 1, by, waited, timeout_s, now)
            count_in(c, OPERATOR_TIMEOUTS + action, len(rows))
        return [r["task_id"] for r in rows]

    def waiting(self, limit: int = 100) -> list[WaitingTask]:
        """The ``unknown`` tasks, those waiting for an operator first (longest first), then
        the ones still reconciled (oldest first)."""
        with self.db.read() as c:
            rows = c.execute(
                f"SELECT {_WAITING_COLUMNS} FROM tasks WHERE state = 'unknown'"
                " ORDER BY operator_since IS NULL, operator_since, unknown_since LIMIT ?",
                (limit,),
            ).fetchall()
        return [_waiting(r) for r in rows]

    def show(self, task_id: str) -> dict[str, Any] | None:
        """One task's uncertain-outcome record: its state and evidence, its reconcile log
        and its compensations (each with the adapter version and effect key digest that
        wrote it), or ``None`` for no such task."""
        with self.db.read() as c:
            task = c.execute(
                "SELECT task_id, principal, message_id, kind, state, attempts, max_attempts,"
                " fence, reconcile_tries, effect_started_at, operator_since,"
                " operator_overdue_at, cancel_requested_at, error, effect_key_digest,"
                " adapter_version FROM tasks WHERE task_id = ?",
                (task_id,),
            ).fetchone()
            if task is None:
                return None
            log = c.execute(
                "SELECT outcome, by_whom, at, fence, observed, note, adapter_version,"
                " effect_key_digest FROM reconcile_log WHERE task_id = ? ORDER BY at, fence",
                (task_id,),
            ).fetchall()
            comps = c.execute(
                "SELECT kind, by_whom, fence, what, started_at, outcome, detail, ended_at,"
                " adapter_version, effect_key_digest FROM compensations WHERE task_id = ?"
                " ORDER BY started_at, kind",
                (task_id,),
            ).fetchall()
        return {
            "task": dict(task),
            "reconcile_log": [{**dict(r), "observed": loads_or_none(r["observed"])} for r in log],
            "compensations": [dict(r) for r in comps],
        }


def _waiting(r: Any) -> WaitingTask:
    return WaitingTask(
        **{
            **dict(r),
            "overdue": bool(r["overdue"]),
            "cancel_requested": bool(r["cancel_requested"]),
        }
    )


def _fail_in(
    c: Conn, task_id: str, fence: int, by: str, waited: float, timeout_s: float, now: float
) -> None:
    """End one overdue task ``failed``, its outcome unknown: fence + 1 (a later answer is
    refused), a reconcile record, the reply with ``effects.reconciled.outcome: unknown``."""
    c.execute(
        "UPDATE tasks SET fence = fence + 1, owner = ?, updated_at = ? WHERE task_id = ?",
        (by, now, task_id),
    )
    note = f"no operator answered within {timeout_s:g} s (waited {waited:.0f} s)"
    log_reconcile(c, task_id, "unknown", by, fence, None, note, now)
    effects = reply_member(c, task_id, "unknown", by, note)
    error = f"the outcome of its effect is unknown: {note}; ended failed by operator_timeout_s"
    to_terminal(c, task_id, TaskState.FAILED, now, error=error, effects=effects)


def outcome_gauges(c: Conn, now: float) -> dict[str, float]:
    """For metrics and ``status``, in the caller's read transaction: the age in seconds of
    the oldest ``unknown`` task (since its effect started) and of the oldest wait for an
    operator (0: none), the waits past their bound (``operator_overdue``) and the
    compensations begun and not ended (``compensations_open``)."""
    row = c.execute(
        "SELECT min(coalesce(effect_started_at, updated_at)) AS unknown_since,"
        " min(operator_since) AS operator_since,"
        " count(*) FILTER (WHERE operator_overdue_at >= operator_since) AS overdue"
        " FROM tasks WHERE state = 'unknown'"
    ).fetchone()
    open_ = c.execute(
        "SELECT count(*) AS n FROM compensations WHERE outcome = 'started'"
    ).fetchone()
    return {
        "oldest_unknown_age_s": _waited_s(now, row["unknown_since"]),
        "oldest_operator_wait_age_s": _waited_s(now, row["operator_since"]),
        "operator_overdue": int(row["overdue"]),
        "compensations_open": int(open_["n"]),
    }


def _waited_s(now: float, since: float | None) -> float:
    return 0.0 if since is None else round(max(0.0, now - float(since)), 3)
