"""Rule 11 carried to its end: a cancel requested after a declared effect started does not
undo it, so the task goes to ``unknown``; its reconcile asks the target (a real process,
``tests.support.fake_target``), and when the effect happened, the registered
``compensate_cancelled`` undoes it once, under one ``cancelled`` compensation record, and
the task ends ``cancelled`` with a reply that says so. The worker, the reconciler and the
stores are the real ones, on a SQLite file and a FakeClock."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.handler.effects import CompensateFn, Observation, effect_spec, side_effect
from broker_adapter.handler.task import Task
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.idempotency import Intent, action_key
from broker_adapter.stages.reconcile.reconciler import ReconcilePolicy, Reconciler
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.stages.worker.worker import Worker
from broker_adapter.store import AcceptItem, OutboxStore, TaskStore, open_database
from broker_adapter.store.effects import EffectsStore
from broker_adapter.store.evidence import key_digest
from broker_adapter.store.task_types import ClaimedTask, TaskPolicy
from tests.support import effect_handlers
from tests.support.fake_target import FakeTarget, FakeTargetClient

pytestmark = pytest.mark.integration

T0 = 1_800_000_000.0
ACTION = effect_handlers.ACTION


@pytest.fixture
def target(tmp_path: Path) -> Iterator[FakeTargetClient]:
    with FakeTarget(tmp_path / "target") as client:
        yield client


@pytest.fixture
def tasks(tmp_path: Path) -> Iterator[TaskStore]:
    with open_database(tmp_path / "tasks.db") as db:
        yield TaskStore(db, FakeClock(T0), TaskPolicy(lease_s=30.0))


def undo_all(task: ClaimedTask, seen: Observation) -> Any:
    """Undo every effect the reconcile found under the key."""
    client = FakeTargetClient(str(task.payload["target"]))
    return {"compensated": [i for i in seen.result["effect_ids"] if client.compensate(i)]}


def handler_cancelled_after_its_effect(
    tasks: TaskStore, undo: CompensateFn | None, *, apply: bool = True
) -> Callable[[Task], Any]:
    """A declared effect that applies its effect (or not), then sees a cancel the operator
    requested meanwhile and stops."""

    @side_effect(ACTION, reconcile=effect_handlers.reconcile, compensate_cancelled=undo)
    def handler(task: Task) -> Any:
        if apply:
            FakeTargetClient(str(task.payload["target"])).apply(1, key=task.effect_key(ACTION))
        EffectsStore(tasks.tx).request_cancel(task.task_id)  # the operator's
        assert task.cancelled()
        raise RuntimeError("stopped on the cancel")

    return handler


def submit(tasks: TaskStore, target: FakeTargetClient) -> str:
    envelope = Envelope.build(
        message_id="m1", sender="agent-a", deadline=T0 + 3600, payload={"target": target.url}
    )
    (result,) = tasks.accept([AcceptItem("agent-a", envelope)])
    assert isinstance(result.task_id, str)
    return result.task_id


def run_and_reconcile(tasks: TaskStore, handler: Callable[[Task], Any]) -> Reconciler:
    worker = Worker(WorkerConfig(owner="w1", batch=1), tasks, handler)
    assert worker.run_once() == 1
    spec = effect_spec(handler)
    assert spec is not None
    return Reconciler(EffectsStore(tasks.tx), spec, "r1", ReconcilePolicy(lease_s=20.0))


def reply(tasks: TaskStore, task_id: str) -> dict[str, Any]:
    (row,) = [r for r in OutboxStore(tasks.db).list(limit=100) if r.task_id == task_id]
    body: dict[str, Any] = json.loads(row.body)
    return body


def state(tasks: TaskStore, task_id: str) -> str:
    row = tasks.get(task_id)
    assert row is not None
    return row.state


def test_a_cancelled_tasks_effect_that_happened_is_undone_once(
    tasks: TaskStore, target: FakeTargetClient
) -> None:
    task_id = submit(tasks, target)
    handler = handler_cancelled_after_its_effect(tasks, undo_all)
    reconciler = run_and_reconcile(tasks, handler)
    assert state(tasks, task_id) == "unknown"  # the cancel cannot undo what started
    assert len(target.effects()) == 1
    assert reconciler.run_once() == 1
    assert target.effects() == []  # the effect was compensated at the target
    assert state(tasks, task_id) == "cancelled"
    fx = EffectsStore(tasks.tx)
    (record,) = fx.compensations(task_id)
    assert (record.kind, record.outcome, record.by_whom) == ("cancelled", "done", "r1")
    body = reply(tasks, task_id)
    assert body["status"] == "cancelled"
    assert "the effect was undone" in body["error"]
    assert body["effects"]["reconciled"]["outcome"] == "done"
    (shown,) = body["effects"]["compensations"]
    assert (shown["kind"], shown["outcome"]) == ("cancelled", "done")
    assert reconciler.run_once() == 0  # ended: nothing to reconcile, nothing undone twice
    assert len(fx.compensations(task_id)) == 1
    reply(tasks, task_id)  # exactly one reply
    # evidence: the records name the effect key's digest and the adapter version
    (log,) = fx.reconcile_log(task_id)
    assert log.outcome == "done"
    with tasks.db.read() as c:
        kept = c.execute(
            "SELECT t.effect_key_digest AS task_digest, t.adapter_version AS task_version,"
            " r.effect_key_digest AS log_digest, r.adapter_version AS log_version,"
            " k.effect_key_digest AS comp_digest, k.adapter_version AS comp_version"
            " FROM tasks t JOIN reconcile_log r ON r.task_id = t.task_id"
            " JOIN compensations k ON k.task_id = t.task_id WHERE t.task_id = ?",
            (task_id,),
        ).fetchone()
    assert kept is not None
    expected = key_digest(action_key(Intent("agent-a", "m1"), ACTION, {"target": target.url}))
    assert kept["task_digest"] == kept["log_digest"] == kept["comp_digest"] == expected
    assert kept["task_version"] == kept["log_version"] == kept["comp_version"]
    assert kept["task_version"]


def test_a_cancelled_tasks_effect_that_did_not_happen_ends_cancelled_without_a_retry(
    tasks: TaskStore, target: FakeTargetClient
) -> None:
    task_id = submit(tasks, target)
    handler = handler_cancelled_after_its_effect(tasks, undo_all, apply=False)
    reconciler = run_and_reconcile(tasks, handler)
    assert state(tasks, task_id) == "unknown"
    assert reconciler.run_once() == 1
    assert state(tasks, task_id) == "cancelled"  # not pending: what was cancelled stays so
    assert EffectsStore(tasks.tx).compensations(task_id) == []
    body = reply(tasks, task_id)
    assert "did not happen" in body["error"]
    assert body["effects"]["reconciled"]["outcome"] == "not-done"
    assert target.effects() == []


def test_without_a_registered_undo_the_effect_stays_and_is_recorded(
    tasks: TaskStore, target: FakeTargetClient
) -> None:
    task_id = submit(tasks, target)
    reconciler = run_and_reconcile(tasks, handler_cancelled_after_its_effect(tasks, None))
    assert reconciler.run_once() == 1
    assert state(tasks, task_id) == "cancelled"
    (record,) = EffectsStore(tasks.tx).compensations(task_id)
    assert (record.kind, record.outcome, record.detail) == (
        "cancelled",
        "failed",
        "none registered",
    )
    assert len(target.effects()) == 1  # nothing undid it
    assert "the effect stays" in reply(tasks, task_id)["error"]


def test_a_cancel_of_an_unknown_task_waits_for_its_reconcile(
    tasks: TaskStore, target: FakeTargetClient
) -> None:
    task_id = submit(tasks, target)
    (claimed,) = tasks.claim("w1")
    fx = EffectsStore(tasks.tx)
    fx.mark_effect_started(task_id, "w1", claimed.fence)
    fx.to_unknown(task_id, "w1", claimed.fence, "timed out")
    assert fx.request_cancel(task_id) == "unknown"  # recorded, not ended blind
    assert state(tasks, task_id) == "unknown"
    spec = effect_spec(handler_cancelled_after_its_effect(tasks, undo_all))
    assert spec is not None
    Reconciler(fx, spec, "r1", ReconcilePolicy(lease_s=20.0)).run_once()
    assert state(tasks, task_id) == "cancelled"
    assert reply(tasks, task_id)["effects"]["reconciled"]["outcome"] == "not-done"
