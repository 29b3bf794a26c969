"""Unknown outcomes end to end, in one process, against the fake target's own process and
SQLite file: the store, the decisions and the reconciler without the worker (its wiring is
separate); the SIGKILLed worker runs of the same stories are the worker's tests."""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.handler.effects import EffectSpec
from broker_adapter.stages.reconcile.reconciler import ReconcilePolicy, Reconciler
from broker_adapter.stages.worker.effect_gate import AfterCall, CallEnd, after_call
from broker_adapter.store import ClaimedTask, TaskState, open_database
from broker_adapter.store.effects import EffectsStore
from tests.support.fake_target import (
    FakeTarget,
    FakeTargetClient,
    compensate_with,
    reconcile_with,
)
from tests.support.store_script import LEASE_S, T0, SqliteStores, item, stores

POLICY = ReconcilePolicy(lease_s=20.0)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def s(tmp_path: Path, clock: FakeClock) -> Iterator[SqliteStores]:
    with open_database(tmp_path / "tasks.db") as db:
        yield stores(db, clock)


@pytest.fixture
def idempotent(tmp_path: Path) -> Iterator[FakeTargetClient]:
    with FakeTarget(tmp_path / "idempotent") as client:
        yield client


@pytest.fixture
def non_idempotent(tmp_path: Path) -> Iterator[FakeTargetClient]:
    with FakeTarget(tmp_path / "plain", idempotent=False) as client:
        yield client


def spec_for(client: FakeTargetClient) -> EffectSpec:
    return EffectSpec(
        "restart", reconcile=reconcile_with(client), compensate=compensate_with(client)
    )


def start(s: SqliteStores, fx: EffectsStore, owner: str = "w1") -> ClaimedTask:
    """Claim the task and mark its irreversible effect started, as the worker does."""
    (task,) = s.tasks.claim(owner)
    fx.mark_effect_started(task.task_id, owner, task.fence)
    return task


def state(s: SqliteStores, task_id: str) -> str:
    row = s.tasks.get(task_id)
    assert row is not None
    return row.state


def test_a_lost_answer_goes_to_unknown_and_the_reconcile_finds_one_effect(
    s: SqliteStores, idempotent: FakeTargetClient
) -> None:
    fx, spec = EffectsStore(s.tasks.tx), spec_for(idempotent)
    s.tasks.accept([item("m1")])
    task = start(s, fx)
    with pytest.raises((OSError, http.client.HTTPException)):
        idempotent.apply("restart web1", key=spec.key(task), drop_response=True)
    assert after_call(CallEnd.TIMED_OUT, effect_started=True) is AfterCall.UNKNOWN
    fx.to_unknown(task.task_id, "w1", task.fence, "call timed out")
    assert Reconciler(fx, spec, "r1", POLICY).run_once() == 1
    assert state(s, task.task_id) == "done"
    assert len(idempotent.effects(spec.key(task))) == 1
    assert s.tasks.claim("w2") == []  # no second call


def test_a_worker_lost_after_the_start_is_reconciled_not_retried(
    s: SqliteStores, idempotent: FakeTargetClient, clock: FakeClock
) -> None:
    fx, spec = EffectsStore(s.tasks.tx), spec_for(idempotent)
    s.tasks.accept([item("m1")])
    task = start(s, fx)
    idempotent.apply("restart web1", key=spec.key(task))  # then the worker is gone
    clock.advance(LEASE_S + 1)
    assert s.tasks.reconcile().get("unknown") == 1
    assert s.tasks.claim("w2") == []  # unknown: never handed to a worker blindly
    Reconciler(fx, spec, "r1", POLICY).run_once()
    assert state(s, task.task_id) == "done"
    assert len(idempotent.effects()) == 1


def test_an_effect_that_never_happened_is_retried_once(
    s: SqliteStores, idempotent: FakeTargetClient, clock: FakeClock
) -> None:
    fx, spec = EffectsStore(s.tasks.tx), spec_for(idempotent)
    s.tasks.accept([item("m1")])
    task = start(s, fx)  # marked, then lost before the call reached the target
    clock.advance(LEASE_S + 1)
    s.tasks.reconcile()
    Reconciler(fx, spec, "r1", POLICY).run_once()
    assert state(s, task.task_id) == "pending"
    again = start(s, fx, "w2")
    assert again.attempt == 2
    idempotent.apply("restart web1", key=spec.key(again))
    s.tasks.finish(again.task_id, "w2", again.fence, {"restarted": True})
    assert len(idempotent.effects()) == 1


def test_a_duplicate_at_a_non_idempotent_target_is_compensated_once(
    s: SqliteStores, non_idempotent: FakeTargetClient
) -> None:
    fx, spec = EffectsStore(s.tasks.tx), spec_for(non_idempotent)
    s.tasks.accept([item("m1")])
    task = start(s, fx)
    key = spec.key(task)
    non_idempotent.apply("charge 5", key=key)
    non_idempotent.apply("charge 5", key=key)  # e.g. the client library's own resend
    fx.to_unknown(task.task_id, "w1", task.fence, "call timed out")
    reconciler = Reconciler(fx, spec, "r1", POLICY)
    reconciler.run_once()
    assert state(s, task.task_id) == TaskState.DONE
    assert len(non_idempotent.effects(key)) == 1  # the second charge was undone
    (record,) = fx.compensations(task.task_id)
    assert (record.outcome, record.by_whom) == ("done", "r1")
    assert reconciler.stats.compensations == 1
    assert reconciler.run_once() == 0
