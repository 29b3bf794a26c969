"""The worker with a declared side effect, in one process, against the fake target (its own
process and SQLite file): approvals checked right before the effect, a timeout after the
start sent to ``unknown``, and the operator's commands (``reconcile``, ``approve``,
``revoke``) through the real command line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypedDict

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.errors import RetryableError, TaskCancelled
from broker_adapter.handler.effects import arguments_digest, side_effect
from broker_adapter.handler.task import Task
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.stages.worker.worker import Worker
from broker_adapter.store import AcceptItem, Database, OutboxStore, TaskStore, open_database
from broker_adapter.store.approvals import ApprovalStore
from broker_adapter.store.effects import EffectsStore
from broker_adapter.store.task_types import TaskPolicy
from tests.support import effect_handlers
from tests.support.cli import run_cli as _cli
from tests.support.fake_target import FakeTarget, FakeTargetClient

pytestmark = pytest.mark.integration

T0 = 1_800_000_000.0
APPROVAL_TIMEOUT_S = 60.0


@pytest.fixture
def target(tmp_path: Path) -> Iterator[FakeTargetClient]:
    with FakeTarget(tmp_path / "target", idempotent=False) as client:
        yield client


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    with open_database(tmp_path / "tasks.db") as opened:
        yield opened


@pytest.fixture
def tasks(db: Database, clock: FakeClock) -> TaskStore:
    return TaskStore(db, clock, TaskPolicy(lease_s=30.0))


def submit(tasks: TaskStore, target: FakeTargetClient, mid: str = "m1", **payload: Any) -> str:
    fields = {"target": target.url, "server": "web1", **payload}
    envelope = Envelope.build(message_id=mid, sender="agent-a", deadline=T0 + 3600, payload=fields)
    (result,) = tasks.accept([AcceptItem("agent-a", envelope)])
    assert isinstance(result.task_id, str)
    return result.task_id


class AskedBy(TypedDict):
    principal: str
    arguments_digest: str


def asked_by(tasks: TaskStore, task_id: str) -> AskedBy:
    """What an approval of ``effect_handlers.approved`` for ``task_id`` is bound to: its
    principal and the digest of its effect's arguments (the whole payload)."""
    row = tasks.db.fetch_one("SELECT principal, payload FROM tasks WHERE task_id = ?", (task_id,))
    assert row is not None
    digest = arguments_digest(effect_handlers.ACTION, json.loads(row["payload"]))
    return {"principal": row["principal"], "arguments_digest": digest}


def worker(tasks: TaskStore, handler: Any, **config: Any) -> Worker:
    settings = {"owner": "w1", "batch": 1, "approval_timeout_s": APPROVAL_TIMEOUT_S, **config}
    return Worker(WorkerConfig(**settings), tasks, handler)


def state(tasks: TaskStore, task_id: str) -> str:
    row = tasks.get(task_id)
    assert row is not None
    return row.state


def reply(tasks: TaskStore, task_id: str) -> dict[str, Any]:
    (row,) = [r for r in OutboxStore(tasks.db).list(limit=100) if r.task_id == task_id]
    body: dict[str, Any] = json.loads(row.body)
    return body


# -- approvals ------------------------------------------------------------------------------


def test_a_forged_approval_in_the_payload_leaves_the_task_waiting(
    tasks: TaskStore, target: FakeTargetClient
) -> None:
    forged = {"action": "apply", "target": "web1", "scope": "restart"}
    task_id = submit(tasks, target, "m1", human_approved=True, approval=forged)
    w = worker(tasks, effect_handlers.approved)
    assert w.run_once() == 1
    assert state(tasks, task_id) == "waiting_approval"
    assert ApprovalStore(tasks.tx).release_waits()["released"] == 0
    assert state(tasks, task_id) == "waiting_approval"
    assert w.run_once() == 0  # nothing to claim: it waits
    assert target.effects() == []
    assert tasks.counts()["waiting_approval"] == 1


def test_a_valid_approval_lets_the_task_run_once(
    tasks: TaskStore, target: FakeTargetClient, clock: FakeClock
) -> None:
    approvals = ApprovalStore(tasks.tx)
    task_id = submit(tasks, target)
    w = worker(tasks, effect_handlers.approved)
    w.run_once()
    assert state(tasks, task_id) == "waiting_approval"
    approvals.grant_approval(
        "apply", "web1", "restart", "alice", T0 + 600, **asked_by(tasks, task_id)
    )
    assert approvals.release_waits()["released"] == 1
    assert w.run_once() == 1
    assert state(tasks, task_id) == "done"
    assert len(target.effects()) == 1
    assert w.run_once() == 0
    row = tasks.get(task_id)
    assert row is not None
    assert row.attempts == 1  # the wait gave its attempt back


@pytest.mark.parametrize("uses", [1, 2])
def test_an_approval_runs_only_its_principals_tasks_with_its_arguments_uses_times(
    tasks: TaskStore, target: FakeTargetClient, uses: int
) -> None:
    """One approval of ``apply`` on web1 (once, the measured defect, it let every task of
    every principal run): bound to agent-a and its arguments, it lets ``uses`` of agent-a's
    identical requests run, none of agent-b's, none with other arguments."""
    approvals = ApprovalStore(tasks.tx)
    same = [submit(tasks, target, f"m{i}") for i in range(3)]
    fields = {"target": target.url, "server": "web1"}
    envelope = Envelope.build(message_id="b1", sender="agent-b", deadline=T0 + 3600, payload=fields)
    other_principal = tasks.accept([AcceptItem("agent-b", envelope)])[0].task_id
    other_arguments = submit(tasks, target, "m-force", force=True)
    assert other_principal is not None
    w = worker(tasks, effect_handlers.approved)
    while w.run_once():
        pass
    everyone = [*same, other_principal, other_arguments]
    assert {state(tasks, t) for t in everyone} == {"waiting_approval"}
    approvals.grant_approval(
        "apply", "web1", "restart", "alice", T0 + 600, uses=uses, **asked_by(tasks, same[0])
    )
    assert approvals.release_waits()["released"] == len(same)  # the other two stay
    while w.run_once():
        pass
    assert [state(tasks, t) for t in same].count("done") == uses
    assert state(tasks, other_principal) == state(tasks, other_arguments) == "waiting_approval"
    assert len(target.effects()) == uses
    assert approvals.release_waits()["released"] == 0  # used up: nothing more runs
    while w.run_once():
        pass
    assert len(target.effects()) == uses


def test_an_approval_revoked_in_between_stops_the_effect(
    tasks: TaskStore, target: FakeTargetClient
) -> None:
    approvals = ApprovalStore(tasks.tx)
    task_id = submit(tasks, target)
    w = worker(tasks, effect_handlers.approved)
    w.run_once()
    approval_id = approvals.grant_approval(
        "apply", "web1", "restart", "alice", T0 + 600, **asked_by(tasks, task_id)
    )
    approvals.release_waits()
    assert state(tasks, task_id) == "pending"
    assert approvals.revoke_approval(approval_id, "bob")
    w.run_once()  # checked again right before the effect: revoked
    assert state(tasks, task_id) == "waiting_approval"
    assert target.effects() == []


def test_past_the_approval_timeout_the_task_ends_with_a_reply(
    tasks: TaskStore, target: FakeTargetClient, clock: FakeClock
) -> None:
    task_id = submit(tasks, target)
    worker(tasks, effect_handlers.approved).run_once()
    clock.advance(APPROVAL_TIMEOUT_S + 1)
    assert ApprovalStore(tasks.tx).release_waits()["timed_out"] == 1
    assert state(tasks, task_id) == "failed"
    body = reply(tasks, task_id)
    assert body["status"] == "failed"
    assert "approval_timeout" in body["error"]
    assert target.effects() == []


# -- unknown after a timeout ----------------------------------------------------------------


def test_a_timeout_after_the_start_goes_to_unknown_and_is_not_retried(
    tasks: TaskStore, target: FakeTargetClient
) -> None:
    @side_effect("apply", reconcile=effect_handlers.reconcile)
    def applies_then_hangs(task: Task) -> None:
        FakeTargetClient(task.payload["target"]).apply(1, key=task.effect_key("apply"))
        task.wait_cancelled(30.0)  # the answer never comes: the call times out

    task_id = submit(tasks, target)
    w = worker(tasks, applies_then_hangs, call_timeout_s=0.2)
    assert w.run_once() == 1
    assert (state(tasks, task_id), w.stats.unknown, w.stats.retried) == ("unknown", 1, 0)
    assert w.run_once() == 0  # not claimed again: the reconcile decides
    assert len(target.effects()) == 1


def test_an_ordinary_handler_is_untouched_by_the_effect_machinery(
    tasks: TaskStore, target: FakeTargetClient
) -> None:
    task_id = submit(tasks, target)
    w = worker(tasks, effect_handlers.keyed)
    assert w.effects is None
    w.run_once()
    assert state(tasks, task_id) == "done"
    marked = tasks.db.fetch_one("SELECT effect_fence FROM tasks WHERE task_id = ?", (task_id,))
    assert marked is not None
    assert marked["effect_fence"] is None


def test_a_handler_marks_its_effect_started_per_call(
    tasks: TaskStore, target: FakeTargetClient
) -> None:
    @side_effect("apply", irreversible=False, reconcile=effect_handlers.reconcile)
    def marks(task: Task) -> None:
        if task.payload.get("start"):
            task.effect_started()
        raise RetryableError("the target did not answer")

    plain, started = submit(tasks, target, "m1"), submit(tasks, target, "m2", start=True)
    w = worker(tasks, marks)
    w.run_once()
    w.run_once()
    # Before the start a retry cannot repeat anything; after it, a retry request is unknown.
    assert (state(tasks, plain), state(tasks, started)) == ("pending", "unknown")
    assert (w.stats.retried, w.stats.unknown) == (1, 1)


# -- the operator's commands ----------------------------------------------------------------


def test_cli_reconcile_answers_an_unknown_task_and_is_audited(tmp_path: Path) -> None:
    path = tmp_path / "ops.db"
    with open_database(path) as db:
        store = TaskStore(db)
        envelope = Envelope.build(
            message_id="m1", sender="agent-a", payload={}, deadline=store.clock.now() + 600
        )
        (accepted,) = store.accept([AcceptItem("agent-a", envelope)])
        (claimed,) = store.claim("w1")
        fx = EffectsStore(store.tx)
        fx.mark_effect_started(claimed.task_id, "w1", claimed.fence)
        fx.to_unknown(claimed.task_id, "w1", claimed.fence, "timeout")
    task_id = str(accepted.task_id)
    done = _cli(
        "reconcile",
        "--db",
        str(path),
        task_id,
        "--outcome",
        "done",
        "--by",
        "carol",
        "--result",
        '{"restarted": true}',
        "--note",
        "checked the console",
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"task_id": task_id, "state": "done"}
    with open_database(path) as db:
        (record,) = EffectsStore(TaskStore(db).tx).reconcile_log(task_id)
    assert (record.outcome, record.observed, record.note) == (
        "done",
        {"restarted": True},
        "checked the console",
    )
    assert record.by_whom.startswith("carol (os user ")
    again = _cli("reconcile", "--db", str(path), task_id, "--outcome", "not-done", "--by", "x")
    assert again.returncode == 1
    assert "not_unknown" in again.stderr or "state is done" in again.stderr


def test_cli_approve_and_revoke(tmp_path: Path) -> None:
    path = tmp_path / "ops.db"
    open_database(path).close()
    granted = _cli(
        "approve",
        "--db",
        str(path),
        "restart",
        "--target",
        "web1",
        "--scope",
        "prod",
        "--principal",
        "agent-a",
        "--arguments",
        '{"server": "web1"}',
        "--expires-in",
        "600",
        "--by",
        "alice",
    )
    assert granted.returncode == 0, granted.stderr
    shown = json.loads(granted.stdout)
    approval_id = shown["approval_id"]
    digest = arguments_digest("restart", {"server": "web1"})
    assert (shown["principal"], shown["arguments"], shown["arguments_digest"], shown["uses"]) == (
        "agent-a",
        {"server": "web1"},
        digest,
        1,
    )
    bound = AskedBy(principal="agent-a", arguments_digest=digest)
    with open_database(path) as db:
        found = ApprovalStore(TaskStore(db).tx).valid_approval("restart", "web1", "prod", **bound)
    assert found is not None
    assert found.approval_id == approval_id
    assert found.approver.startswith("alice (os user ")
    revoked = _cli("revoke", "--db", str(path), approval_id, "--by", "bob")
    assert (revoked.returncode, json.loads(revoked.stdout)["revoked"]) == (0, True)
    with open_database(path) as db:
        assert (
            ApprovalStore(TaskStore(db).tx).valid_approval("restart", "web1", "prod", **bound)
            is None
        )
    twice = _cli("revoke", "--db", str(path), approval_id, "--by", "bob")
    assert twice.returncode == 1
    unnamed = _cli(
        "approve",
        "--db",
        str(path),
        "restart",
        "--target",
        "web1",
        "--scope",
        "prod",
        "--expires-in",
        "600",
    )
    assert unnamed.returncode == 2  # --by is required


# -- cancel of a running task ---------------------------------------------------------------


def test_a_cancel_requested_while_the_handler_runs_is_seen_and_the_reply_says_what_happened(
    tasks: TaskStore, target: FakeTargetClient
) -> None:
    seen: list[bool] = []

    def stops_on_cancel(task: Task) -> None:
        assert not task.cancelled()
        state_now = EffectsStore(tasks.tx).request_cancel(task.task_id)  # the operator's
        assert state_now == "running"
        seen.append(task.cancelled())  # seen at its next check
        raise RuntimeError("stopped half way")

    task_id = submit(tasks, target)
    worker(tasks, stops_on_cancel).run_once()
    assert seen == [True]
    assert state(tasks, task_id) == "cancelled"
    body = reply(tasks, task_id)
    assert body["status"] == "cancelled"
    assert "cancel requested" in body["error"]
    assert "RuntimeError: stopped half way" in body["error"]


def test_a_requested_cancel_stops_renewals_after_the_grace_and_the_lapse_ends_it(
    tasks: TaskStore, target: FakeTargetClient, clock: FakeClock
) -> None:
    task_id = submit(tasks, target)
    (claimed,) = tasks.claim("w1")
    EffectsStore(tasks.tx).request_cancel(task_id)
    grace = tasks.policy.cancel_grace_s
    clock.advance(min(grace, tasks.policy.lease_s) - 1)
    assert tasks.renew(task_id, "w1", claimed.fence) > clock.now()  # within the grace
    clock.set(T0 + grace)
    with pytest.raises(TaskCancelled):
        tasks.renew(task_id, "w1", claimed.fence)
    clock.advance(tasks.policy.lease_s)
    assert tasks.reconcile()["cancelled"] == 1
    body = reply(tasks, task_id)
    assert (body["status"], state(tasks, task_id)) == ("cancelled", "cancelled")
    assert "did not end within the grace" in body["error"]


def test_a_requested_cancel_of_a_started_effect_whose_lease_lapses_is_unknown(
    tasks: TaskStore, target: FakeTargetClient, clock: FakeClock
) -> None:
    task_id = submit(tasks, target)
    (claimed,) = tasks.claim("w1")
    fx = EffectsStore(tasks.tx)
    fx.mark_effect_started(task_id, "w1", claimed.fence)
    fx.request_cancel(task_id)
    clock.advance(tasks.policy.lease_s + 1)
    assert tasks.reconcile()["unknown"] == 1  # whether it happened: for the reconcile
    assert state(tasks, task_id) == "unknown"
