"""The reads behind the web console (``broker_adapter.console``): the pipeline per group,
task search, one task's whole story and the decisions waiting for an operator.

One SQL text for both stores (``store.sql``); every function here only reads, in one
read transaction. The console's writes are not here: they go through the same store
methods as the CLI's commands (``approvals.ApprovalStore.grant_approval``,
``effects.EffectsStore.operator_resolve`` and ``request_cancel``, the outbox's replay).

The pipeline is grouped by the task columns ``PIPELINE_GROUPS`` names (``principal``); a
column of ``tasks`` added later (a task name) is one more entry there, and every count of
the four stages follows it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final

from broker_adapter.store.report import LIVE_NAMES, TERMINAL_NAMES, snapshot
from broker_adapter.store.sql import Conn, Db

#: The columns of ``tasks`` the pipeline may be grouped by (a whitelist: the names are
#: written into the SQL text). ``outbox`` and ``inbox`` are joined to ``tasks`` for them.
PIPELINE_GROUPS: Final = ("principal",)

#: Task states ``search_tasks`` accepts.
TASK_STATES: Final = (*LIVE_NAMES, *TERMINAL_NAMES)

#: Rows a search or a list returns at most.
LIST_LIMIT: Final = 200


@dataclass
class StageRow:
    """The four stages of one group (e.g. one principal): counts and ages in seconds."""

    group: str
    received: int = 0
    last_received_age_s: float | None = None
    processing: dict[str, int] = field(default_factory=dict)
    oldest_open_age_s: float | None = None
    outcome: dict[str, int] = field(default_factory=dict)
    delivery: dict[str, int] = field(default_factory=dict)
    oldest_unsent_age_s: float | None = None


@dataclass(frozen=True)
class Pipeline:
    """The pipeline at one moment: the store's ``report.snapshot`` totals, the same stages
    per group, and the oldest unsent reply (``None``: every reply is sent or dead)."""

    totals: dict[str, Any]
    groups: list[StageRow]
    oldest_unsent: dict[str, Any] | None


def _age(now: float, at: Any) -> float | None:
    return None if at is None else round(max(0.0, now - float(at)), 3)


def pipeline(db: Db, now: float, group_by: str = "principal") -> Pipeline:
    """The four stages apart (received, processing, business outcome, reply delivery),
    in total and per ``group_by`` (one of ``PIPELINE_GROUPS``), with their ages.

    Raises:
        ValueError: ``group_by`` is not a known grouping column.
    """
    if group_by not in PIPELINE_GROUPS:
        raise ValueError(f"cannot group the pipeline by {group_by!r}")
    totals = snapshot(db, now)
    rows: dict[str, StageRow] = {}

    def row(key: Any) -> StageRow:
        name = str(key)
        return rows.setdefault(name, StageRow(name))

    g = group_by
    with db.read() as c:
        for r in c.execute(
            f"SELECT t.{g} AS g, count(*) AS n, max(i.received_at) AS last FROM inbox i"
            f" JOIN tasks t ON t.task_id = i.task_id GROUP BY t.{g}"
        ).fetchall():
            s = row(r["g"])
            s.received, s.last_received_age_s = r["n"], _age(now, r["last"])
        for r in c.execute(
            f"SELECT {g} AS g, state, count(*) AS n, min(created_at) AS oldest FROM tasks"
            f" GROUP BY {g}, state"
        ).fetchall():
            s = row(r["g"])
            if r["state"] in TERMINAL_NAMES:
                s.outcome[r["state"]] = r["n"]
                continue
            s.processing[r["state"]] = r["n"]
            age = _age(now, r["oldest"])
            if age is not None and (s.oldest_open_age_s is None or age > s.oldest_open_age_s):
                s.oldest_open_age_s = age
        for r in c.execute(
            f"SELECT t.{g} AS g, o.state, count(*) AS n, min(o.created_at) AS oldest"
            f" FROM outbox o JOIN tasks t ON t.task_id = o.task_id GROUP BY t.{g}, o.state"
        ).fetchall():
            s = row(r["g"])
            s.delivery[r["state"]] = r["n"]
            if r["state"] in ("pending", "sending"):
                age = _age(now, r["oldest"])
                if age is not None and (
                    s.oldest_unsent_age_s is None or age > s.oldest_unsent_age_s
                ):
                    s.oldest_unsent_age_s = age
        oldest = c.execute(
            "SELECT reply_id, task_id, principal, message_id, status, state, attempts,"
            " last_error, created_at FROM outbox WHERE state IN ('pending', 'sending')"
            " ORDER BY created_at LIMIT 1"
        ).fetchone()
    unsent = None
    if oldest is not None:
        unsent = {**dict(oldest), "age_s": _age(now, oldest["created_at"])}
    return Pipeline(totals, [rows[k] for k in sorted(rows)], unsent)


_SUMMARY = (
    "SELECT task_id, principal, message_id, state, attempts, max_attempts, fence,"
    " created_at, updated_at FROM tasks"
)


def search_tasks(
    db: Db,
    *,
    task_id: str | None = None,
    message_id: str | None = None,
    principal: str | None = None,
    state: str | None = None,
    limit: int = LIST_LIMIT,
) -> list[dict[str, Any]]:
    """Tasks matching every given field exactly, newest first, at most ``limit``.

    Raises:
        ValueError: ``state`` is not a task state, or ``limit`` is not in 1..LIST_LIMIT.
    """
    if state is not None and state not in TASK_STATES:
        raise ValueError(f"no task state {state!r}")
    if not 1 <= limit <= LIST_LIMIT:
        raise ValueError(f"limit must be in 1..{LIST_LIMIT}")
    where: list[str] = []
    params: list[Any] = []
    for column, value in (
        ("task_id", task_id),
        ("message_id", message_id),
        ("principal", principal),
        ("state", state),
    ):
        if value:
            where.append(f"{column} = ?")
            params.append(value)
    sql = _SUMMARY + (" WHERE " + " AND ".join(where) if where else "")
    with db.read() as c:
        rows = c.execute(f"{sql} ORDER BY created_at DESC LIMIT ?", (*params, limit)).fetchall()
    return [dict(r) for r in rows]


def _loads(text: Any) -> Any:
    if text is None:
        return None
    if isinstance(text, bytes | bytearray | memoryview):
        text = bytes(text).decode("utf-8", "replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def task_story(db: Db, task_id: str) -> dict[str, Any] | None:
    """Everything the store keeps about one task, or ``None`` if there is no such task:
    ``task`` (its row, payload and result decoded), ``inbox`` (the request records that
    point at it), ``events`` (its timeline, oldest first), ``approval_wait``,
    ``approvals`` (the records for the action, target and scope it waits on or waited
    on), ``reconcile_log``, ``compensations`` and ``reply`` (its outbox row, body decoded,
    with whether it was delivered)."""
    with db.read() as c:
        task = c.execute("SELECT * FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
        if task is None:
            return None
        t = dict(task)
        t["payload"], t["result"] = _loads(t["payload"]), _loads(t["result"])
        inbox = [
            dict(r)
            for r in c.execute(
                "SELECT principal, message_id, entry_id, received_at, duplicates, conflicts"
                " FROM inbox WHERE task_id = ? ORDER BY received_at",
                (task_id,),
            ).fetchall()
        ]
        wait = c.execute(
            "SELECT action, target, scope, since, until FROM approval_waits WHERE task_id = ?",
            (task_id,),
        ).fetchone()
        log = [
            {**dict(r), "observed": _loads(r["observed"])}
            for r in c.execute(
                "SELECT outcome, by_whom, at, fence, observed, note FROM reconcile_log"
                " WHERE task_id = ? ORDER BY at, fence",
                (task_id,),
            ).fetchall()
        ]
        comps = [
            dict(r)
            for r in c.execute(
                "SELECT kind, by_whom, fence, what, started_at, outcome, detail, ended_at"
                " FROM compensations WHERE task_id = ? ORDER BY started_at, kind",
                (task_id,),
            ).fetchall()
        ]
        reply_row = c.execute("SELECT * FROM outbox WHERE task_id = ?", (task_id,)).fetchone()
        approvals = _approvals_for(c, t, None if wait is None else dict(wait))
    reply = None
    if reply_row is not None:
        reply = dict(reply_row)
        reply["body"] = _loads(reply["body"])
        reply["delivered"] = reply["state"] == "sent"
    story = {
        "task": t,
        "inbox": inbox,
        "approval_wait": None if wait is None else dict(wait),
        "approvals": approvals,
        "reconcile_log": log,
        "compensations": comps,
        "reply": reply,
    }
    story["events"] = _events(story)
    return story


def _approvals_for(c: Conn, task: dict[str, Any], wait: dict[str, Any] | None) -> list[Any]:
    """The approvals that released the task (``approval_releases``, ``released_at`` set)
    and, while it waits, the records of the action, target and scope it waits on; the
    ``approver`` of each is what the audit recorded."""
    cols = (
        "a.approval_id, a.action, a.target, a.scope, a.approver, a.granted_at,"
        " a.expires_at, a.revoked_at, a.revoked_by"
    )
    rows = [
        dict(r)
        for r in c.execute(
            f"SELECT {cols}, r.released_at FROM approval_releases r JOIN approvals a"
            " ON a.approval_id = r.approval_id WHERE r.task_id = ? ORDER BY r.released_at",
            (task["task_id"],),
        ).fetchall()
    ]
    if wait is not None:
        seen = {r["approval_id"] for r in rows}
        for r in c.execute(
            f"SELECT {cols} FROM approvals a WHERE a.action = ? AND a.target = ?"
            " AND a.scope = ? ORDER BY a.granted_at",
            (wait["action"], wait["target"], wait["scope"]),
        ).fetchall():
            if r["approval_id"] not in seen:
                rows.append({**dict(r), "released_at": None})
    return rows


def _events(story: dict[str, Any]) -> list[dict[str, Any]]:
    """The timeline the rows keep, oldest first: ``at``, ``what``, ``detail``."""
    t = story["task"]
    ev: list[dict[str, Any]] = []

    def add(at: Any, what: str, detail: str = "") -> None:
        if at is not None:
            ev.append({"at": float(at), "what": what, "detail": detail})

    for r in story["inbox"]:
        add(r["received_at"], "received", f"entry {r['entry_id'] or '-'}")
    add(t["created_at"], "stored", f"state pending, max attempts {t['max_attempts']}")
    add(t.get("effect_started_at"), "effect started", f"fence {t.get('effect_fence')}")
    add(t.get("cancel_requested_at"), "cancel requested")
    w = story["approval_wait"]
    if w is not None:
        add(w["since"], "waiting for approval", f"{w['action']} on {w['target']} ({w['scope']})")
    for a in story["approvals"]:
        add(a["granted_at"], "approval granted", f"by {a['approver']}")
        add(a["released_at"], "released by an approval", f"approved by {a['approver']}")
        add(a["revoked_at"], "approval revoked", f"by {a['revoked_by']}")
    add(t.get("operator_since"), "waiting for an operator", "the outcome is unknown")
    for r in story["reconcile_log"]:
        add(r["at"], f"reconciled {r['outcome']}", f"by {r['by_whom']}, fence {r['fence']}")
    for r in story["compensations"]:
        add(r["started_at"], f"compensation {r['kind']} started", f"by {r['by_whom']}")
        add(r["ended_at"], f"compensation {r['kind']} {r['outcome']}")
    add(t["finished_at"], f"ended {t['state']}", t["error"] or "")
    reply = story["reply"]
    if reply is not None:
        add(reply["created_at"], "reply written", f"status {reply['status']}")
        add(reply["sent_at"], "reply delivered", f"entry {reply['entry_id']}")
        add(reply.get("replayed_at"), "reply replayed", f"by {reply.get('replayed_by')}")
    ev.sort(key=lambda e: e["at"])
    return ev


def waiting_approvals(db: Db, limit: int = LIST_LIMIT) -> list[dict[str, Any]]:
    """Tasks waiting for an approval, oldest wait first: what they will do (``action``,
    ``target``, ``scope``), their payload (decoded) and when the wait ends (``until``)."""
    with db.read() as c:
        rows = c.execute(
            "SELECT w.task_id, w.action, w.target, w.scope, w.since, w.until, t.principal,"
            " t.message_id, t.payload FROM approval_waits w JOIN tasks t"
            " ON t.task_id = w.task_id WHERE t.state = 'waiting_approval'"
            " ORDER BY w.since LIMIT ?",
            (limit,),
        ).fetchall()
    return [{**dict(r), "payload": _loads(r["payload"])} for r in rows]


def unknown_outcomes(db: Db, limit: int = LIST_LIMIT) -> list[dict[str, Any]]:
    """Tasks whose outcome is unknown, those waiting for an operator first
    (``operator_since`` set: the automatic reconcile gave up), with their payload."""
    with db.read() as c:
        rows = c.execute(
            "SELECT task_id, principal, message_id, payload, fence, attempts,"
            " reconcile_tries, operator_since, effect_started_at, error FROM tasks"
            " WHERE state = 'unknown'"
            " ORDER BY operator_since IS NULL, operator_since, effect_started_at LIMIT ?",
            (limit,),
        ).fetchall()
    return [{**dict(r), "payload": _loads(r["payload"])} for r in rows]


def dead_replies(db: Db, limit: int = LIST_LIMIT) -> list[dict[str, Any]]:
    """Replies the dispatcher gave up on (outbox ``dead``), newest first."""
    with db.read() as c:
        rows = c.execute(
            "SELECT reply_id, task_id, principal, message_id, status, attempts, last_error,"
            " created_at, replays, replayed_by FROM outbox WHERE state = 'dead'"
            " ORDER BY created_at DESC LIMIT ?",
            (limit,),
        ).fetchall()
    return [dict(r) for r in rows]
