"""The reconcile's records, shared by every way an ``unknown`` task ends
(``effects.EffectsStore``, ``cancel_reconcile``, ``operator_waits``): the holder check of a
reconcile (``unknown_holder``), the audit row every outcome writes in the transaction that
acts on it (``log_reconcile``, table ``reconcile_log``), the reply member that tells how a
task was reconciled (``reply_member``) and the audit's read (``reconcile_records``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from broker_adapter.protocol.canonical import canonical_json
from broker_adapter.store.counters import RECONCILED, count_in
from broker_adapter.store.evidence import ADAPTER_VERSION, EVIDENCE
from broker_adapter.store.fencing import fence_refusal
from broker_adapter.store.sql import Conn
from broker_adapter.store.task_types import TaskState, UnknownTask

ReconcileOutcome = Literal["done", "not-done", "unknown"]


@dataclass(frozen=True)
class ReconcileRecord:
    task_id: str
    outcome: str
    by_whom: str
    at: float
    fence: int
    observed: Any
    note: str | None


def unknown_holder(c: Conn, task_id: str, owner: str, fence: int, now: float) -> Any:
    """Rule 10 for a reconcile (``fencing.fence_refusal``): the task is ``unknown``, held by
    ``owner`` under ``fence``, the lease not run out (the deadline does not count here:
    see ``fencing``). The row stays locked for the caller's writes (``for_update``)."""
    row = c.execute(
        "SELECT task_id, state, owner, fence, lease_until, attempts, max_attempts, deadline"
        f" FROM tasks WHERE task_id = ?{c.dialect.for_update}",
        (task_id,),
    ).fetchone()
    if row is None:
        raise UnknownTask(task_id)
    refused = fence_refusal(
        row, task_id, owner, fence, now, state=TaskState.UNKNOWN, deadline=False
    )
    if refused is not None:
        raise refused
    return row


def log_reconcile(
    c: Conn,
    task_id: str,
    outcome: ReconcileOutcome,
    by: str,
    fence: int,
    observed: Any,
    note: str | None,
    now: float,
    *,
    raw: bool = False,
) -> None:
    """Record a reconcile's ``outcome`` for ``task_id``, found by ``by`` under ``fence``,
    with what it ``observed`` (JSON, or its canonical text already with ``raw``) and the
    effect's evidence, and count it (``counters.RECONCILED``), in the caller's transaction."""
    text = observed if raw else None if observed is None else canonical_json(observed).decode()
    c.execute(
        "INSERT INTO reconcile_log (task_id, outcome, by_whom, at, fence, observed, note,"
        f" adapter_version, effect_key_digest) VALUES (?, ?, ?, ?, ?, ?, ?, ?, {EVIDENCE})",
        (
            task_id,
            outcome,
            by,
            now,
            fence,
            text,
            c.dialect.text(note),
            ADAPTER_VERSION,
            task_id,
        ),
    )
    count_in(c, RECONCILED + outcome)


def reply_member(c: Conn, task_id: str, outcome: str, by: str, note: str | None) -> dict[str, Any]:
    """The reply body's ``effects`` member for a task a reconcile ends: how it was
    reconciled (``outcome``, ``by``, ``note``, and ``tries`` that found nothing before) and
    its compensations (``docs/PROTOCOL.md`` section 11)."""
    tries = c.execute(
        "SELECT count(*) AS n FROM reconcile_log WHERE task_id = ? AND outcome = 'unknown'",
        (task_id,),
    ).fetchone()["n"]
    member: dict[str, Any] = {
        "reconciled": {"outcome": outcome, "by": by, "note": note, "tries": tries},
    }
    rows = c.execute(
        "SELECT kind, outcome, by_whom, what, detail FROM compensations WHERE task_id = ?"
        " ORDER BY started_at, kind",
        (task_id,),
    ).fetchall()
    if rows:
        member["compensations"] = [
            {
                "kind": r["kind"],
                "outcome": r["outcome"],
                "by": r["by_whom"],
                "what": r["what"],
                "detail": r["detail"],
            }
            for r in rows
        ]
    return member


def reconcile_records(c: Conn, task_id: str) -> list[ReconcileRecord]:
    """The reconcile audit of one task, oldest first (the caller's read transaction)."""
    rows = c.execute(
        "SELECT task_id, outcome, by_whom, at, fence, observed, note FROM reconcile_log"
        " WHERE task_id = ? ORDER BY at, fence",
        (task_id,),
    ).fetchall()
    return [ReconcileRecord(**{**dict(r), "observed": loads_or_none(r["observed"])}) for r in rows]


def loads_or_none(text: str | None) -> Any:
    """A JSON column's value: ``None`` for SQL NULL."""
    return None if text is None else json.loads(text)
