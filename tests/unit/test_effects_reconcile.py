"""Declared effects (``handler.effects``), the worker's decision after a call (``after_call``), the
decision after a reconcile (pure) and the ``Reconciler`` applying them through the store, on a
FakeClock."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from broker_adapter.backoff import Backoff
from broker_adapter.clock import FakeClock
from broker_adapter.errors import ConfigError
from broker_adapter.handler.effects import EffectSpec, Observation, effect_spec, side_effect
from broker_adapter.stages.reconcile.reconciler import (
    ReconcilePolicy,
    Reconciler,
    ReconcileStep,
    after_reconcile,
)
from broker_adapter.stages.worker.effect_gate import (
    AfterCall,
    CallEnd,
    after_call,
    current_approval,
    hold_for_approval,
)
from broker_adapter.store import ClaimedTask
from broker_adapter.store.approvals import ApprovalStore
from broker_adapter.store.effects import EffectsStore
from tests.support.store_script import T0, Stores, dump, item, open_any, stores, task_state

POLICY = ReconcilePolicy(
    lease_s=20.0, batch=8, max_tries=3, backoff=Backoff(base_s=10.0, cap_s=40.0)
)


@pytest.fixture
def s(store_target: str, clock: FakeClock) -> Iterator[Stores]:
    """The stores on SQLite and on PostgreSQL (``store_target``)."""
    with open_any(store_target) as db:
        yield stores(db, clock)


def unknown_task(s: Stores, fx: EffectsStore, mid: str = "m1", **over: Any) -> str:
    """A task whose worker timed out after its effect started."""
    s.tasks.accept([item(mid, **over)])
    (task,) = s.tasks.claim("w1")
    fx.mark_effect_started(task.task_id, "w1", task.fence)
    fx.to_unknown(task.task_id, "w1", task.fence, "timed out")
    return task.task_id


def result_of(s: Stores, task_id: str) -> Any:
    (found,) = [r for r in dump(s.db)["outbox"] if r["task_id"] == task_id]
    return json.loads(found["body"])["result"]


class Target:
    """What a reconcile function would ask: the effects applied per key."""

    def __init__(self) -> None:
        self.applied: dict[str, int] = {}
        self.asked: list[tuple[str, str]] = []
        self.compensated: list[str] = []

    def reconcile(self, task: ClaimedTask, key: str) -> Observation:
        self.asked.append((task.task_id, key))
        n = self.applied.get(key, 0)
        if n == 0:
            return Observation.not_happened("no effect under the key")
        return Observation.happened({"effects": n}, applied=n)

    def compensate(self, task: ClaimedTask, seen: Observation) -> Any:
        self.compensated.append(task.task_id)
        return {"undone": seen.applied - 1}


# -- decisions ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("end", "started", "retryable", "expected"),
    [
        (CallEnd.RETURNED, True, False, AfterCall.SETTLE),
        (CallEnd.LEASE_LOST, True, False, AfterCall.NOTHING),
        (CallEnd.LEASE_LOST, False, False, AfterCall.NOTHING),
        (CallEnd.TIMED_OUT, False, False, AfterCall.SETTLE),
        (CallEnd.TIMED_OUT, True, False, AfterCall.UNKNOWN),
        (CallEnd.STOPPED, True, False, AfterCall.UNKNOWN),
        (CallEnd.RAISED, True, True, AfterCall.UNKNOWN),
        (CallEnd.RAISED, True, False, AfterCall.SETTLE),
        (CallEnd.RAISED, False, True, AfterCall.SETTLE),
    ],
)
def test_after_call(end: CallEnd, started: bool, retryable: bool, expected: AfterCall) -> None:
    assert after_call(end, effect_started=started, retryable=retryable) is expected


def test_after_reconcile_done_retry_back_off_operator() -> None:
    now = T0
    assert after_reconcile(Observation.happened(1), 0, POLICY, now) == ReconcileStep("done")
    assert after_reconcile(Observation.happened(1, applied=2), 0, POLICY, now) == ReconcileStep(
        "done", compensate=True
    )
    assert after_reconcile(Observation.not_happened(), 2, POLICY, now) == ReconcileStep("retry")
    step = after_reconcile(Observation.still_unknown(), 0, POLICY, now, random.Random(1))
    assert step.kind == "back_off"
    assert step.retry_at is not None
    ceiling = POLICY.backoff.ceiling(1)
    assert now + ceiling / 2 <= step.retry_at <= now + ceiling
    last = POLICY.max_tries - 1
    assert after_reconcile(Observation.still_unknown(), last, POLICY, now) == ReconcileStep(
        "operator"
    )


@pytest.mark.parametrize(
    ("outcome", "applied"), [("maybe", 1), ("done", 0), ("done", True), ("unknown", 1.5)]
)
def test_an_observation_says_one_of_three_things(outcome: str, applied: Any) -> None:
    with pytest.raises(ValueError, match=r"outcome|applied"):
        Observation(outcome, applied=applied)  # type: ignore[arg-type]


def test_a_reconcile_that_answers_nonsense_knows_nothing(s: Stores, fx: EffectsStore) -> None:
    task_id = unknown_task(s, fx)
    spec = EffectSpec("restart", reconcile=lambda task, key: "yes")  # type: ignore[arg-type,return-value]
    reconciler = Reconciler(fx, spec, "r1", POLICY)
    reconciler.run_once()
    assert task_state(s, task_id) == "unknown"
    (record,) = fx.reconcile_log(task_id)
    assert record.note == "reconcile returned str"


def test_the_key_is_the_same_in_every_attempt_and_names_the_action() -> None:
    spec = EffectSpec("restart", arguments=lambda t: {"server": t.payload["q"]})
    base = ClaimedTask(
        "t1", "alice", "m1", "task", {"q": "web1"}, 1, 3, 1, "w1", T0, T0, 0, None, None
    )
    later = dataclasses.replace(base, task_id="t2", attempt=3, fence=7, owner="w9")
    assert spec.key(base) == spec.key(later)
    assert EffectSpec("stop").key(base) != spec.key(base)
    other = dataclasses.replace(base, payload={"q": "web2"})
    assert spec.key(other) != spec.key(base)


def test_side_effect_declares_and_checks() -> None:
    @side_effect("restart", reconcile=Target().reconcile)
    def handler(task: object) -> None:
        return None

    spec = effect_spec(handler)
    assert spec is not None
    assert (spec.action, spec.irreversible, spec.requires_approval) == ("restart", True, False)
    assert effect_spec(lambda t: None) is None
    with pytest.raises(ConfigError, match="approval"):
        side_effect("restart", requires_approval=True)
    with pytest.raises(ConfigError, match="action"):
        EffectSpec("")


# -- the reconciler -------------------------------------------------------------------------


def test_found_effect_is_done_with_the_observed_result_without_a_second_call(
    s: Stores, fx: EffectsStore
) -> None:
    target = Target()
    spec = EffectSpec("restart", reconcile=target.reconcile)
    task_id = unknown_task(s, fx)
    target.applied[spec.key(_claim_view(s, task_id))] = 1
    reconciler = Reconciler(fx, spec, "r1", POLICY)
    assert reconciler.run_once() == 1
    assert task_state(s, task_id) == "done"
    assert result_of(s, task_id) == {"effects": 1}
    ((asked_id, key),) = target.asked
    assert asked_id == task_id
    assert key == spec.key(_claim_view(s, task_id))
    assert s.tasks.claim("w2") == []  # nothing runs again
    assert [r.by_whom for r in fx.reconcile_log(task_id)] == ["r1"]


def test_nothing_found_is_retried(s: Stores, fx: EffectsStore) -> None:
    target = Target()
    task_id = unknown_task(s, fx)
    reconciler = Reconciler(fx, EffectSpec("restart", reconcile=target.reconcile), "r1", POLICY)
    reconciler.run_once()
    assert task_state(s, task_id) == "pending"
    (again,) = s.tasks.claim("w2")
    assert (again.task_id, again.attempt) == (task_id, 2)
    assert reconciler.stats.not_done == 1


def test_still_unknown_backs_off_then_waits_for_an_operator(
    s: Stores, fx: EffectsStore, clock: FakeClock
) -> None:
    def broken(task: ClaimedTask, key: str) -> Observation:
        raise ConnectionError("target down")

    task_id = unknown_task(s, fx)
    reconciler = Reconciler(
        fx, EffectSpec("restart", reconcile=broken), "r1", POLICY, random.Random(3)
    )
    for _ in range(POLICY.max_tries):
        assert reconciler.run_once() == 1
        assert reconciler.run_once() == 0  # backing off
        clock.advance(POLICY.backoff.cap_s)
    assert reconciler.run_once() == 0
    assert (reconciler.stats.unknown, reconciler.stats.operator) == (POLICY.max_tries - 1, 1)
    assert task_state(s, task_id) == "unknown"
    log = fx.reconcile_log(task_id)
    assert all(r.outcome == "unknown" for r in log)
    assert log[0].note is not None
    assert "ConnectionError: target down" in log[0].note
    assert fx.operator_resolve(task_id, "not-done", "alice").value == "pending"


def test_without_a_reconcile_function_an_operator_decides(s: Stores, fx: EffectsStore) -> None:
    task_id = unknown_task(s, fx)
    reconciler = Reconciler(fx, EffectSpec("restart"), "r1", POLICY)
    reconciler.run_once()
    assert reconciler.stats.operator == 1
    assert fx.counts()["awaiting_operator"] == 1
    assert task_state(s, task_id) == "unknown"


def test_a_duplicate_is_compensated_once_even_across_reconcilers(
    s: Stores, fx: EffectsStore, clock: FakeClock
) -> None:
    target = Target()
    spec = EffectSpec("charge", reconcile=target.reconcile, compensate=target.compensate)
    task_id = unknown_task(s, fx)
    target.applied[spec.key(_claim_view(s, task_id))] = 2

    def slow_compensation(task: ClaimedTask, seen: Observation) -> Any:
        clock.advance(POLICY.lease_s)  # the first reconciler's lease runs out meanwhile
        return target.compensate(task, seen)

    first = Reconciler(fx, dataclasses.replace(spec, compensate=slow_compensation), "r1", POLICY)
    first.run_once()
    assert first.stats.stale == 1
    assert task_state(s, task_id) == "unknown"
    second = Reconciler(fx, spec, "r2", POLICY)
    second.run_once()
    assert task_state(s, task_id) == "done"
    assert target.compensated == [task_id]  # once, though two reconcilers saw the duplicate
    (record,) = fx.compensations(task_id)
    assert (record.by_whom, record.outcome, record.detail) == ("r1", "done", '{"undone":1}')


def test_a_failing_compensation_is_recorded_failed(s: Stores, fx: EffectsStore) -> None:
    target = Target()

    def refuses(task: ClaimedTask, seen: Observation) -> Any:
        raise RuntimeError("refund refused")

    spec = EffectSpec("charge", reconcile=target.reconcile, compensate=refuses)
    task_id = unknown_task(s, fx)
    target.applied[spec.key(_claim_view(s, task_id))] = 3
    Reconciler(fx, spec, "r1", POLICY).run_once()
    (record,) = fx.compensations(task_id)
    assert (record.outcome, record.detail) == ("failed", "RuntimeError: refund refused")
    assert task_state(s, task_id) == "done"


# -- approvals ------------------------------------------------------------------------------


def test_a_forged_approval_in_the_payload_counts_for_nothing(s: Stores) -> None:
    ap = ApprovalStore(s.tasks.tx)
    spec = EffectSpec(
        "restart", requires_approval=True, approval=lambda t: (str(t.payload["server"]), "prod")
    )
    s.tasks.accept([item("m1", payload={"server": "web1", "human_approved": True})])
    (task,) = s.tasks.claim("w1")
    assert current_approval(ap, spec, task) is None
    hold_for_approval(ap, spec, task, 60)
    assert task_state(s, task.task_id) == "waiting_approval"
    # bound to the principal and the digest of the arguments (here the whole payload)
    ap.grant_approval(
        "restart",
        "web1",
        "prod",
        "carol",
        T0 + 600,
        principal="alice",
        arguments_digest=spec.approval_digest(task),
    )
    ap.release_waits()
    (again,) = s.tasks.claim("w1")
    found = current_approval(ap, spec, again)
    assert found is not None
    assert found.approver == "carol"


def _claim_view(s: Stores, task_id: str) -> ClaimedTask:
    """A claim-shaped view of a stored task (what a reconcile function gets)."""
    row = s.tasks.get(task_id)
    assert row is not None
    (stored,) = [r for r in dump(s.db)["tasks"] if r["task_id"] == task_id]
    return ClaimedTask(
        task_id,
        row.principal,
        row.message_id,
        "task",
        json.loads(stored["payload"]),
        row.attempts,
        row.max_attempts,
        row.fence,
        "",
        0.0,
        row.deadline,
        0,
        None,
        None,
    )
