"""Uncertain outcomes an operator sees and bounds (``store.operator_waits``): a task that
waits for an operator past ``ReconcilePolicy.operator_timeout_s`` raises the alert or ends
``failed`` as configured (on a FakeClock, both sides of the bound), the age gauges, and the
alert rules' expressions under ``promtool test rules``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.errors import StaleError
from broker_adapter.handler.effects import EffectSpec
from broker_adapter.stages.reconcile.reconciler import ReconcilePolicy, Reconciler
from broker_adapter.store.effects import EffectsStore
from broker_adapter.store.operator_waits import OperatorWaits
from broker_adapter.store.report import snapshot
from tests.support.promtool import HAVE_PROMTOOL, alert_test, needs_promtool, shipped_rules
from tests.support.store_script import Stores, item, open_any, reply_body, stores, task_state

TIMEOUT_S = 600.0
JOB = {"job": "broker-adapter"}


@pytest.fixture
def s(store_target: str, clock: FakeClock) -> Iterator[Stores]:
    with open_any(store_target) as db:
        yield stores(db, clock)


def waiting_for_operator(s: Stores, fx: EffectsStore, policy: ReconcilePolicy) -> str:
    """A task whose effect started, whose worker timed out, and whose reconcile cannot
    tell (no reconcile function): it waits for an operator from now on."""
    s.tasks.accept([item("m1")])
    (task,) = s.tasks.claim("w1")
    fx.mark_effect_started(task.task_id, "w1", task.fence, key_digest="d" * 64)
    fx.to_unknown(task.task_id, "w1", task.fence, "timed out")
    reconciler = Reconciler(fx, EffectSpec("restart"), "r1", policy)
    assert reconciler.run_once() == 1
    assert reconciler.stats.operator == 1
    return task.task_id


def effects_now(s: Stores, clock: FakeClock) -> dict[str, Any]:
    report: dict[str, Any] = snapshot(s.db, clock.now())["effects"]
    return report


def policy(action: str) -> ReconcilePolicy:
    return ReconcilePolicy(
        lease_s=20.0, operator_timeout_s=TIMEOUT_S, operator_timeout_action=action
    )


def test_an_operator_wait_past_its_bound_raises_the_alert_and_keeps_waiting(
    s: Stores, clock: FakeClock, tmp_path: Path
) -> None:
    fx = EffectsStore(s.tasks.tx)
    task_id = waiting_for_operator(s, fx, policy("alert"))
    reconciler = Reconciler(fx, EffectSpec("restart"), "r1", policy("alert"))
    clock.advance(TIMEOUT_S - 0.001)  # just inside the bound
    assert reconciler.bound_operator_waits() == []
    before = effects_now(s, clock)
    assert before["operator_overdue"] == 0
    assert before["oldest_operator_wait_age_s"] == pytest.approx(TIMEOUT_S - 0.001)
    assert before["oldest_unknown_age_s"] == pytest.approx(TIMEOUT_S - 0.001)
    clock.advance(0.001)  # at the bound
    assert reconciler.bound_operator_waits() == [task_id]
    after = effects_now(s, clock)
    assert (after["operator_overdue"], after["operator_timeouts_alert"]) == (1, 1)
    assert task_state(s, task_id) == "unknown"  # still the operator's to answer
    clock.advance(TIMEOUT_S)
    assert reconciler.run_once() == 0  # a waiting task is not reconciled, nor bounded twice
    assert effects_now(s, clock)["operator_timeouts_alert"] == 1
    if not HAVE_PROMTOOL:
        pytest.skip("no promtool: the alert's expression is not checked")
    b, a = before["operator_overdue"], after["operator_overdue"]
    series = {
        'ba_operator_waits_overdue{job="broker-adapter",instance="a:9464"}': f"{b} {b} {a} {a}"
    }
    firing = {"severity": "critical", **JOB}
    overdue = "BrokerAdapterOperatorWaitOverdue"
    res = alert_test(tmp_path, series, [("1m", overdue, []), ("2m", overdue, [firing])])
    assert res.returncode == 0, res.stdout + res.stderr
    # the operator's answer still ends it, and the overdue gauge falls with it
    assert fx.operator_resolve(task_id, "not-done", "alice") in ("pending", "failed", "expired")
    assert effects_now(s, clock)["operator_overdue"] == 0


def test_an_operator_wait_past_its_bound_ends_failed_with_its_outcome_unknown(
    s: Stores, clock: FakeClock, tmp_path: Path
) -> None:
    fx = EffectsStore(s.tasks.tx)
    task_id = waiting_for_operator(s, fx, policy("fail"))
    reconciler = Reconciler(fx, EffectSpec("restart"), "r1", policy("fail"))
    clock.advance(TIMEOUT_S - 0.001)
    reconciler.run_once()
    assert task_state(s, task_id) == "unknown"
    before = effects_now(s, clock)["operator_timeouts_fail"]
    clock.advance(0.001)
    reconciler.run_once()
    assert task_state(s, task_id) == "failed"
    after = effects_now(s, clock)["operator_timeouts_fail"]
    assert (before, after) == (0, 1)
    body = reply_body(s, task_id)
    assert body["status"] == "failed"
    assert "outcome of its effect is unknown" in body["error"]
    assert body["effects"]["reconciled"]["outcome"] == "unknown"
    assert body["effects"]["reconciled"]["by"] == "r1"
    with pytest.raises(StaleError):  # the fence moved: a late answer is refused
        fx.operator_resolve(task_id, "done", "alice")
    shown = OperatorWaits(fx).show(task_id)
    assert shown is not None
    last = shown["reconcile_log"][-1]
    assert last["outcome"] == "unknown"
    assert "no operator answered within 600 s" in last["note"]
    assert last["effect_key_digest"] == "d" * 64
    assert last["adapter_version"]
    if not HAVE_PROMTOOL:
        pytest.skip("no promtool: the alert's expression is not checked")
    name = 'ba_operator_timeouts_total{action="fail",job="broker-adapter",instance="a:9464"}'
    firing = {"severity": "critical", "job": "broker-adapter"}
    res = alert_test(
        tmp_path,
        {name: f"{before} {before} {after} {after}"},
        [
            ("1m", "BrokerAdapterOperatorTimeoutFailed", []),
            ("2m", "BrokerAdapterOperatorTimeoutFailed", [firing]),
        ],
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_timeout_action_must_be_alert_or_fail(s: Stores) -> None:
    with pytest.raises(ValueError, match="alert or fail"):
        OperatorWaits(EffectsStore(s.tasks.tx)).bound_waits(1.0, "shrug", "r1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="operator_timeout_action"):
        ReconcilePolicy(operator_timeout_action="shrug")
    with pytest.raises(ValueError, match="operator_timeout_s"):
        ReconcilePolicy(operator_timeout_s=0)


def test_reconcile_list_shows_waiting_tasks_first(s: Stores, clock: FakeClock) -> None:
    fx = EffectsStore(s.tasks.tx)
    waiting = waiting_for_operator(s, fx, policy("alert"))
    s.tasks.accept([item("m2")])
    (task,) = s.tasks.claim("w1")
    fx.mark_effect_started(task.task_id, "w1", task.fence)
    fx.to_unknown(task.task_id, "w1", task.fence, "timed out")
    listed = OperatorWaits(fx).waiting()
    assert [w.task_id for w in listed] == [waiting, task.task_id]
    assert listed[0].operator_since == pytest.approx(clock.now())
    assert listed[1].operator_since is None
    assert listed[0].effect_key_digest == "d" * 64
    assert not listed[0].overdue


# -- the rules' expressions, both sides of each bound ---------------------------------------------


@needs_promtool
def test_uncertain_outcome_alerts_fire_past_their_bounds_only(tmp_path: Path) -> None:
    assert {
        "BrokerAdapterOperatorWaiting",
        "BrokerAdapterUnknownOutcomeOld",
        "BrokerAdapterCompensationFailed",
        "BrokerAdapterCompensationUnfinished",
        "BrokerAdapterApprovalsWaiting",
    } <= set(shipped_rules())
    at = 'job="broker-adapter",instance="a:9464"'
    series = {
        f"ba_operator_wait_oldest_age_seconds{{{at}}}": "3540 3600 3660 3720",
        f"ba_unknown_oldest_age_seconds{{{at}}}": "3700x10",
        f'ba_compensations_total{{outcome="failed",{at}}}': "0 0 1 1",
        f"ba_compensations_open{{{at}}}": "1x20",
        f"ba_approvals_waiting{{{at}}}": "1x40",
    }
    warning, critical = {"severity": "warning", **JOB}, {"severity": "critical", **JOB}
    expect = [
        ("1m", "BrokerAdapterOperatorWaiting", []),  # 3600: not above the hour
        ("2m", "BrokerAdapterOperatorWaiting", [warning]),
        ("4m", "BrokerAdapterUnknownOutcomeOld", []),  # above, for 4 of 5 minutes
        ("5m", "BrokerAdapterUnknownOutcomeOld", [warning]),
        ("1m", "BrokerAdapterCompensationFailed", []),
        ("2m", "BrokerAdapterCompensationFailed", [critical]),
        ("14m", "BrokerAdapterCompensationUnfinished", []),
        ("15m", "BrokerAdapterCompensationUnfinished", [warning]),
        ("29m", "BrokerAdapterApprovalsWaiting", []),
        ("30m", "BrokerAdapterApprovalsWaiting", [warning]),
    ]
    res = alert_test(tmp_path, series, expect)
    assert res.returncode == 0, res.stdout + res.stderr
