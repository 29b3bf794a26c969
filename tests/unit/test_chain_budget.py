"""The chain budget: tasks counted per principal and ``correlation_id`` by the system at accept
(``store.inbox``, ``TaskPolicy.max_chain_tasks``), and a handler's requests joined to its
task's chain by the library (``client.publisher.chained``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from broker_adapter.client.publisher import chained
from broker_adapter.clock import FakeClock
from broker_adapter.handler.task import Task
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.store import AcceptItem, Outcome, TaskStore
from broker_adapter.store.task_types import TaskPolicy
from tests.support.store_script import T0, dump, envelope, open_any

BUDGET = 3


@pytest.fixture
def tasks(store_target: str) -> Iterator[TaskStore]:
    """The budget on SQLite and on PostgreSQL (its ``chains`` table, migration 2 there)."""
    with open_any(store_target) as db:
        yield TaskStore(db, FakeClock(T0), TaskPolicy(max_chain_tasks=BUDGET))


def accept(tasks: TaskStore, principal: str, env: Envelope) -> Any:
    (result,) = tasks.accept([AcceptItem(principal, env)])
    return result


def reply_of(tasks: TaskStore, task_id: str) -> dict[str, Any]:
    (row,) = [r for r in dump(tasks.db)["outbox"] if r["task_id"] == task_id]
    body: dict[str, Any] = json.loads(row["body"])
    return body


def test_chain_budgets_are_counted_per_principal_so_nobody_spends_anothers(
    tasks: TaskStore,
) -> None:
    def spend(principal: str, n: int) -> list[Any]:
        return [
            accept(
                tasks,
                principal,
                envelope(f"{principal}-{i}", sender=principal, correlation_id="chain-1"),
            )
            for i in range(n)
        ]

    # bob names alice's correlation_id: he spends a budget of his own, not hers
    assert [r.outcome for r in spend("bob", BUDGET + 1)] == [Outcome.STORED] * BUDGET + [
        Outcome.HOP_LIMIT
    ]
    alice = spend("alice", BUDGET + 1)
    assert [r.outcome for r in alice] == [Outcome.STORED] * BUDGET + [Outcome.HOP_LIMIT]
    body = reply_of(tasks, alice[-1].task_id)
    assert body["status"] == "hop_limit"
    assert "chain 'chain-1' of alice" in body["error"]
    # Another chain, and requests without one, are not touched.
    other = accept(tasks, "bob", envelope("m10", sender="bob", correlation_id="chain-2"))
    assert other.outcome is Outcome.STORED
    assert accept(tasks, "bob", envelope("m11", sender="bob")).outcome is Outcome.STORED


def test_a_resend_of_a_stored_request_does_not_spend_the_budget(
    tasks: TaskStore,
) -> None:
    first = envelope("m1", correlation_id="c")
    for _ in range(BUDGET + 2):
        accept(tasks, "alice", first)
    rest = [accept(tasks, "alice", envelope(f"m{i}", correlation_id="c")) for i in (2, 3)]
    assert [r.outcome for r in rest] == [Outcome.STORED, Outcome.STORED]


def test_a_chain_that_drops_its_parent_id_but_keeps_its_correlation_id_is_still_stopped(
    tasks: TaskStore,
) -> None:
    root = accept(tasks, "alice", envelope("root"))
    (claimed,) = tasks.claim("w1")
    parent = Task(claimed)
    # The library joins a handler's request to its task's chain ...
    child = chained(envelope("child-0", hops=0, correlation_id="mine"), parent)
    assert (child.parent_id, child.correlation_id, child.hops) == (root.task_id, root.task_id, 1)
    outcomes = [accept(tasks, "alice", child).outcome]
    # ... and an agent hiding its chain drops parent_id and resets hops: its hop count
    # starts again, but the chain it names still counts every task.
    for i in range(1, BUDGET + 1):
        hidden = child.replace(message_id=f"child-{i}", parent_id=None, hops=0)
        outcomes.append(accept(tasks, "alice", hidden).outcome)
    assert outcomes == [Outcome.STORED] * BUDGET + [Outcome.HOP_LIMIT]


def test_the_deadline_and_hop_checks_come_before_the_budget(tasks: TaskStore) -> None:
    past = accept(tasks, "alice", envelope("old", correlation_id="c", deadline=T0 - 1))
    assert past.outcome is Outcome.EXPIRED
    stored = [accept(tasks, "alice", envelope(f"m{i}", correlation_id="c")) for i in range(3)]
    assert all(r.outcome is Outcome.STORED for r in stored)  # the expired one did not count
