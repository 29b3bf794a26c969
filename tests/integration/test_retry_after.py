"""A target that answers ``429 Too Many Requests`` with ``Retry-After`` (the fake target, its
own process): the handler raises ``RetryableError(retry_after_s=...)`` and the retry waits
that long (the larger of it and the backoff), capped by the deadline and the attempts. The
worker and the store are the real ones, on a SQLite file and a FakeClock; time is moved by
the test, never slept."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.backoff import Backoff
from broker_adapter.clock import FakeClock
from broker_adapter.errors import RetryableError
from broker_adapter.handler.task import Task
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.stages.worker.worker import Worker
from broker_adapter.store import AcceptItem, OutboxStore, TaskStore, open_database
from broker_adapter.store.task_types import TaskPolicy
from tests.support.fake_target import FakeTarget, FakeTargetClient, TargetError

pytestmark = pytest.mark.integration

T0 = 1_800_000_000.0
#: The backoff between attempts: at most 1 s, so a Retry-After above it is what decides.
BACKOFF = Backoff(base_s=1.0, cap_s=1.0)


@pytest.fixture
def target(tmp_path: Path) -> Iterator[FakeTargetClient]:
    with FakeTarget(tmp_path / "target") as client:
        yield client


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def tasks(tmp_path: Path, clock: FakeClock) -> Iterator[TaskStore]:
    with open_database(tmp_path / "tasks.db") as db:
        yield TaskStore(db, clock, TaskPolicy(lease_s=30.0, backoff=BACKOFF))


def polite(task: Task) -> Any:
    """Apply the effect; a 429 asks for a retry no sooner than the target's Retry-After."""
    client = FakeTargetClient(str(task.payload["target"]))
    try:
        return client.apply(task.payload["what"], key=task.effect_key("apply"))
    except TargetError as exc:
        if exc.status == 429 and exc.retry_after is not None:
            raise RetryableError(
                "the target answered 429", retry_after_s=float(exc.retry_after)
            ) from None
        raise


def submit(
    tasks: TaskStore,
    target: FakeTargetClient,
    *,
    deadline_in: float = 3600.0,
    max_attempts: int = 3,
) -> str:
    envelope = Envelope.build(
        message_id="m1",
        sender="agent-a",
        deadline=T0 + deadline_in,
        max_attempts=max_attempts,
        payload={"target": target.url, "what": "charge"},
    )
    (result,) = tasks.accept([AcceptItem("agent-a", envelope)])
    assert isinstance(result.task_id, str)
    return result.task_id


def run(tasks: TaskStore) -> int:
    return Worker(WorkerConfig(owner="w1", batch=1), tasks, polite).run_once()


def row(tasks: TaskStore, task_id: str) -> Any:
    found = tasks.get(task_id)
    assert found is not None
    return found


def reply_error(tasks: TaskStore, task_id: str) -> str:
    (reply,) = [r for r in OutboxStore(tasks.db).list(limit=10) if r.task_id == task_id]
    error: str = json.loads(reply.body)["error"]
    return error


def test_the_retry_waits_for_the_targets_retry_after(
    tasks: TaskStore, target: FakeTargetClient, clock: FakeClock
) -> None:
    task_id = submit(tasks, target)
    target.throttle(1, "120")
    assert run(tasks) == 1
    found = row(tasks, task_id)
    assert (found.state, found.attempts) == ("pending", 1)
    assert found.not_before == T0 + 120  # not the backoff's second: the target's two minutes
    clock.set(T0 + 120 - 0.001)
    assert run(tasks) == 0  # not due a millisecond before
    clock.set(T0 + 120)
    assert run(tasks) == 1
    assert row(tasks, task_id).state == "done"
    assert (len(target.effects()), target.throttled()) == (1, 1)


def test_a_retry_after_below_the_backoff_waits_for_the_backoff(
    tasks: TaskStore, target: FakeTargetClient
) -> None:
    task_id = submit(tasks, target)
    target.throttle(1, "0")
    run(tasks)
    found = row(tasks, task_id)
    assert found.state == "pending"
    assert T0 + BACKOFF.ceiling(1) / 2 <= found.not_before <= T0 + BACKOFF.ceiling(1)


def test_a_retry_after_past_the_deadline_ends_the_task_now(
    tasks: TaskStore, target: FakeTargetClient
) -> None:
    task_id = submit(tasks, target, deadline_in=600.0)
    target.throttle(1, "600")  # the retry would start at the deadline: none follows
    run(tasks)
    assert row(tasks, task_id).state == "failed"
    assert "no retry: the deadline comes first" in reply_error(tasks, task_id)
    assert target.effects() == []


def test_a_retry_after_just_inside_the_deadline_is_waited_for(
    tasks: TaskStore, target: FakeTargetClient, clock: FakeClock
) -> None:
    task_id = submit(tasks, target, deadline_in=600.0)
    target.throttle(1, "599.5")
    run(tasks)
    assert row(tasks, task_id).not_before == T0 + 599.5
    clock.set(T0 + 599.5)
    run(tasks)
    assert row(tasks, task_id).state == "done"


def test_retry_after_does_not_add_attempts(
    tasks: TaskStore, target: FakeTargetClient, clock: FakeClock
) -> None:
    task_id = submit(tasks, target, max_attempts=2)
    target.throttle(5, "30")
    run(tasks)
    clock.set(T0 + 30)
    run(tasks)
    found = row(tasks, task_id)
    assert (found.state, found.attempts) == ("failed", 2)
    assert "attempts exhausted" in reply_error(tasks, task_id)
    assert (target.throttled(), target.effects()) == (2, [])


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_retry_after_must_be_a_finite_non_negative_number(bad: float) -> None:
    with pytest.raises(ValueError, match="retry_after_s"):
        RetryableError("throttled", retry_after_s=bad)
    assert RetryableError("throttled").retry_after_s is None
    assert RetryableError("throttled", retry_after_s=0).retry_after_s == 0.0
