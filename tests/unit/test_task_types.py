"""The task states and the claim's columns are written once (``store.task_types``); what the
schema repeats in its migrations (never edited) must agree with them."""

from __future__ import annotations

import re
from pathlib import Path

from broker_adapter.clock import FakeClock
from broker_adapter.store.db import open_database
from broker_adapter.store.task_types import (
    CLAIM_COLUMNS,
    CLOCKED_SQL,
    TERMINAL_SQL,
    ClaimedTask,
    TaskState,
    claimed_task,
)
from broker_adapter.store.tasks import TaskStore


def test_the_sqlite_schema_allows_exactly_the_task_states(tmp_path: Path) -> None:
    with open_database(tmp_path / "states.db") as db, db.read() as c:
        sql = c.execute("SELECT sql FROM sqlite_master WHERE name = 'tasks'").fetchone()["sql"]
        index = c.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'tasks_live_deadline'"
        ).fetchone()["sql"]
    check = re.search(r"state TEXT NOT NULL CHECK \(([^)]*)\)", " ".join(sql.split()))
    assert check is not None
    assert re.findall(r"'(\w+)'", check.group(1)) == [s.value for s in TaskState]
    # a statement uses the partial index only if it repeats the index's predicate
    assert f"state IN {CLOCKED_SQL}" in " ".join(index.split())


def test_the_sql_state_lists() -> None:
    assert TERMINAL_SQL == "('done', 'failed', 'cancelled', 'expired', 'hop_limit')"
    assert CLOCKED_SQL == "('pending', 'running')"


def test_a_claim_reads_every_field_but_the_two_it_sets(tmp_path: Path) -> None:
    assert CLAIM_COLUMNS == (
        "task_id, principal, message_id, kind, payload, attempts, max_attempts, fence,"
        " deadline, hops, correlation_id, parent_id, traceparent, task_name"
    )
    with open_database(tmp_path / "claim.db") as db:
        TaskStore(db, FakeClock(1000.0))  # the schema is there
        with db.read() as c:
            columns = {r["name"] for r in c.execute("PRAGMA table_info(tasks)").fetchall()}
    assert set(CLAIM_COLUMNS.split(", ")) <= columns
    row = {
        "task_id": "t1",
        "principal": "p",
        "message_id": "m",
        "kind": "task",
        "payload": '{"a": 1}',
        "attempts": 2,
        "max_attempts": 3,
        "fence": 4,
        "deadline": 2000,
        "hops": 0,
        "correlation_id": None,
        "parent_id": None,
        "traceparent": None,
        "task_name": "n",
    }
    assert claimed_task(row, "w", 1030.0) == ClaimedTask(
        task_id="t1",
        principal="p",
        message_id="m",
        kind="task",
        payload={"a": 1},
        attempt=2,
        max_attempts=3,
        fence=4,
        owner="w",
        lease_until=1030.0,
        deadline=2000.0,
        hops=0,
        correlation_id=None,
        parent_id=None,
        task_name="n",
    )
