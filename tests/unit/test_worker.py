"""The worker on a file-backed SQLite store and a FakeClock: outcomes, leases, cancel, stop.

Nothing here sleeps to let time pass: time moves by ``FakeClock.advance``, renewals are
driven by ``Worker.renew_leases()``, and every real wait is on an event with a timeout.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from broker_adapter import crashpoints
from broker_adapter.clock import FakeClock
from broker_adapter.errors import ConfigError, RetryableError
from broker_adapter.handler.task import Task
from broker_adapter.protocol.bounds import PAYLOAD_MAX_BYTES, PAYLOAD_MAX_DEPTH, PAYLOAD_MAX_NODES
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.stages.worker.config import DEFAULT_BATCH, WorkerConfig
from broker_adapter.stages.worker.worker import Worker
from broker_adapter.store import (
    AcceptItem,
    ClaimedTask,
    Database,
    OutboxStore,
    TaskStore,
    open_database,
)
from broker_adapter.store.task_types import TaskPolicy
from tests.support import handlers as sample

WAIT_S = 10.0
LEASE_S = 30.0


@pytest.fixture
def tasks(db: Database, clock: FakeClock) -> TaskStore:
    return TaskStore(db, clock, TaskPolicy(lease_s=LEASE_S), rng=random.Random(7))


@pytest.fixture
def outbox(db: Database, clock: FakeClock) -> OutboxStore:
    return OutboxStore(db, clock)


def submit(
    tasks: TaskStore,
    clock: FakeClock,
    payload: dict[str, Any] | None = None,
    *,
    message_id: str = "m1",
    max_attempts: int = 3,
    deadline_in_s: float = 3600.0,
) -> str:
    env = Envelope.build(
        message_id=message_id,
        sender="agent-a",
        payload=payload if payload is not None else {"x": 1},
        deadline=clock.now() + deadline_in_s,
        max_attempts=max_attempts,
    )
    (result,) = tasks.accept([AcceptItem("agent-a", env)])
    assert result.task_id is not None
    return result.task_id


def make_worker(tasks: TaskStore, handler: Callable[[Task], Any] | str, **settings: Any) -> Worker:
    settings.setdefault("owner", "w1")
    return Worker(WorkerConfig(**settings), tasks, handler)


def replies(outbox: OutboxStore, task_id: str) -> list[dict[str, Any]]:
    return [json.loads(r.body) for r in outbox.list() if r.task_id == task_id]


def only_reply(outbox: OutboxStore, task_id: str) -> dict[str, Any]:
    (body,) = replies(outbox, task_id)
    return body


def state(tasks: TaskStore, task_id: str) -> str:
    row = tasks.get(task_id)
    assert row is not None
    return row.state


def wait_until(predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    """Wait for a condition another thread brings about (never for time to pass)."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        pause.wait(0.005)


# -- outcomes -----------------------------------------------------------------------------


def test_worker_return_value_finishes_task_with_reply(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock
) -> None:
    task_id = submit(tasks, clock, {"q": "hi"})
    worker = make_worker(tasks, "tests.support.handlers:ok")
    assert worker.run_once() == 1
    assert state(tasks, task_id) == "done"
    body = only_reply(outbox, task_id)
    assert body["status"] == "done"
    assert body["result"] == {"echo": {"q": "hi"}, "attempt": 1}
    assert (body["attempts"], body["fence"]) == (1, 1)
    assert worker.stats.claimed == worker.stats.done == 1


def test_worker_run_once_returns_zero_when_nothing_is_ready(tasks: TaskStore) -> None:
    assert make_worker(tasks, sample.ok).run_once() == 0


def test_worker_retryable_error_goes_back_to_pending_then_done(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock
) -> None:
    task_id = submit(tasks, clock)
    worker = make_worker(tasks, sample.flaky)
    assert worker.run_once() == 1
    row = tasks.get(task_id)
    assert row is not None
    assert (row.state, row.attempts) == ("pending", 1)
    assert row.error == "RetryableError: upstream unavailable on attempt 1"
    assert row.not_before > clock.now()  # backoff
    assert replies(outbox, task_id) == []
    assert worker.run_once() == 0  # still backing off
    clock.advance(row.not_before - clock.now())
    assert worker.run_once() == 1
    body = only_reply(outbox, task_id)
    assert (body["status"], body["result"], body["attempts"]) == ("done", {"attempt": 2}, 2)
    assert (worker.stats.retried, worker.stats.done) == (1, 1)


def test_worker_exception_with_retryable_attribute_is_retried(
    tasks: TaskStore, clock: FakeClock
) -> None:
    task_id = submit(tasks, clock)
    worker = make_worker(tasks, sample.busy)
    worker.run_once()
    assert state(tasks, task_id) == "pending"
    assert worker.stats.retried == 1


def test_worker_retryable_error_on_last_attempt_fails(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock
) -> None:
    task_id = submit(tasks, clock, max_attempts=1)
    worker = make_worker(tasks, sample.flaky)
    worker.run_once()
    body = only_reply(outbox, task_id)
    assert body["status"] == "failed"
    assert "attempts exhausted" in body["error"]
    assert worker.stats.failed == 1


def test_worker_other_exception_fails_with_error_text_in_reply(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock
) -> None:
    task_id = submit(tasks, clock, {"bad": True})
    worker = make_worker(tasks, sample.always_fail)
    worker.run_once()
    assert state(tasks, task_id) == "failed"
    body = only_reply(outbox, task_id)
    assert body["status"] == "failed"
    assert body["error"] == "ValueError: cannot handle {'bad': True}"
    assert worker.stats.failed == 1


def test_worker_timeout_is_a_retryable_failure(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock
) -> None:
    task_id = submit(tasks, clock)
    seen: list[str | None] = []
    ended = threading.Event()

    def slow(task: Task) -> str:
        task.wait_cancelled(WAIT_S)
        seen.append(task.stop_reason)
        ended.set()
        return "too late"

    worker = make_worker(tasks, slow, call_timeout_s=0.05)
    worker.run_once()
    row = tasks.get(task_id)
    assert row is not None
    assert row.state == "pending"
    assert row.error is not None
    assert row.error.startswith("TimeoutError: the handler did not return within 0.050 s")
    assert worker.stats.timeouts == worker.stats.retried == 1
    assert ended.wait(WAIT_S)  # the abandoned call saw cancelled() and ended
    assert seen == ["timeout"]
    assert replies(outbox, task_id) == []  # its late result was dropped


def test_worker_timeout_is_capped_by_the_deadline(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock
) -> None:
    task_id = submit(tasks, clock, {"seconds": WAIT_S}, deadline_in_s=0.05)
    worker = make_worker(tasks, sample.slow, call_timeout_s=WAIT_S)
    started = time.monotonic()
    worker.run_once()
    assert time.monotonic() - started < WAIT_S / 2
    body = only_reply(outbox, task_id)
    assert body["status"] == "failed"  # the backoff would pass the deadline: no retry
    assert "TimeoutError" in body["error"]
    assert "deadline comes first" in body["error"]


@pytest.mark.parametrize("handler", [sample.non_json, lambda task: {"x": float("nan")}])
def test_worker_non_json_result_fails_with_clear_error(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock, handler: Callable[[Task], Any]
) -> None:
    task_id = submit(tasks, clock)
    worker = make_worker(tasks, handler)
    worker.run_once()
    body = only_reply(outbox, task_id)
    assert body["status"] == "failed"
    assert "Error: the handler returned a non-JSON result: " in body["error"]
    assert worker.stats.failed == 1


def _deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("result", "over"),
    [
        ("x" * (PAYLOAD_MAX_BYTES - 2), False),  # 65,536 bytes canonical
        ("x" * (PAYLOAD_MAX_BYTES - 1), True),
        (_deep(PAYLOAD_MAX_DEPTH), False),
        (_deep(PAYLOAD_MAX_DEPTH + 1), True),
        ([0] * (PAYLOAD_MAX_NODES - 1), False),  # the array and its items: 10,000 nodes
        ([0] * PAYLOAD_MAX_NODES, True),
    ],
    ids=["bytes-at", "bytes-over", "depth-at", "depth-over", "nodes-at", "nodes-over"],
)
def test_worker_result_over_the_bounds_fails_the_task_without_a_retry(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock, result: Any, over: bool
) -> None:
    task_id = submit(tasks, clock, max_attempts=3)
    worker = make_worker(tasks, lambda task: result)
    assert worker.run_once() == 1
    body = only_reply(outbox, task_id)
    row = tasks.get(task_id)
    assert row is not None
    assert row.attempts == 1
    if over:
        assert (row.state, body["status"], body["result"]) == ("failed", "failed", None)
        assert body["error"].startswith("result_too_large: result ")
        assert (worker.stats.failed, worker.stats.retried) == (1, 0)
    else:
        assert (row.state, body["status"], body["error"]) == ("done", "done", None)
        assert body["result"] == result
        assert worker.stats.done == 1


def test_worker_runs_async_handlers(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock
) -> None:
    task_id = submit(tasks, clock)
    worker = make_worker(tasks, "tests.support.handlers:async_ok")
    worker.run_once()
    assert only_reply(outbox, task_id)["result"] == {"async": True, "echo": {"x": 1}}


def test_worker_async_timeout_is_retryable(tasks: TaskStore, clock: FakeClock) -> None:
    task_id = submit(tasks, clock)
    worker = make_worker(tasks, sample.async_hang, call_timeout_s=0.05)
    worker.run_once()
    assert state(tasks, task_id) == "pending"
    assert worker.stats.timeouts == 1


# -- cancellation -------------------------------------------------------------------------


def test_worker_cancel_during_run_commits_nothing(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock
) -> None:
    task_id = submit(tasks, clock)
    seen: list[bool] = []

    def cancelled_midway(task: Task) -> str:
        seen.append(task.cancelled())
        tasks.cancel(task.task_id, "operator changed their mind")
        seen.append(task.cancelled())
        return "result nobody will see"

    worker = make_worker(tasks, cancelled_midway)
    worker.run_once()
    assert seen == [False, True]
    assert state(tasks, task_id) == "cancelled"
    body = only_reply(outbox, task_id)
    assert (body["status"], body["error"], body["result"]) == (
        "cancelled",
        "operator changed their mind",
        None,
    )
    assert worker.stats.cancelled == 1
    assert worker.stats.done == worker.stats.failed == worker.stats.stale_commits == 0


def test_worker_cancel_seen_at_renewal_even_if_handler_ignores_it(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock
) -> None:
    task_id = submit(tasks, clock)
    worker: Worker

    def ignores_cancel(task: Task) -> str:
        tasks.cancel(task.task_id)
        assert worker.renew_leases() == 0
        assert task.wait_cancelled(0)
        assert task.stop_reason == "cancelled"
        return "done anyway"

    worker = make_worker(tasks, ignores_cancel)
    worker.run_once()
    assert state(tasks, task_id) == "cancelled"
    assert len(replies(outbox, task_id)) == 1
    assert worker.stats.cancelled == 1


def test_worker_skips_a_task_cancelled_before_its_handler_started(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock
) -> None:
    first = submit(tasks, clock, message_id="m1")
    clock.advance(0.001)  # claim order follows not_before
    second = submit(tasks, clock, message_id="m2")
    ran: list[str] = []

    def cancels_the_next(task: Task) -> str:
        ran.append(task.task_id)
        tasks.cancel(second)
        return "ok"

    worker = make_worker(tasks, cancels_the_next, batch=2)
    assert worker.run_once() == 2
    assert ran == [first]
    assert (state(tasks, first), state(tasks, second)) == ("done", "cancelled")
    assert len(replies(outbox, second)) == 1
    assert (worker.stats.done, worker.stats.cancelled) == (1, 1)


def test_worker_expires_a_task_whose_deadline_passed_before_it_started(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock
) -> None:
    first = submit(tasks, clock, message_id="m1")
    clock.advance(0.001)
    second = submit(tasks, clock, message_id="m2", deadline_in_s=10)
    ran: list[str] = []

    def takes_eleven_seconds(task: Task) -> str:
        ran.append(task.task_id)
        clock.advance(11)
        return "ok"

    worker = make_worker(tasks, takes_eleven_seconds, batch=2)
    worker.run_once()
    assert ran == [first]
    assert (state(tasks, first), state(tasks, second)) == ("done", "expired")
    assert only_reply(outbox, second)["status"] == "expired"
    assert worker.stats.expired == 1


# -- leases -------------------------------------------------------------------------------


def test_worker_lost_lease_commit_is_refused_and_counted(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock, db: Database
) -> None:
    task_id = submit(tasks, clock)
    other_db = open_database(db.path)  # the second owner: another connection, same file
    other = TaskStore(other_db, clock, TaskPolicy(lease_s=LEASE_S))
    seen: dict[str, Any] = {}
    worker: Worker

    def frozen_past_its_lease(task: Task) -> str:
        clock.advance(LEASE_S + 1)
        (taken,) = other.claim("w2", 1)
        seen["taken"] = taken
        seen["held"] = worker.renew_leases()
        seen["cancelled"] = task.cancelled()
        seen["lost"] = task.lease_lost
        return "stale result"

    worker = make_worker(tasks, frozen_past_its_lease)
    try:
        worker.run_once()
        taken = seen["taken"]
        assert (taken.owner, taken.fence, taken.attempt) == ("w2", 2, 2)
        assert seen["held"] == 0
        assert seen["cancelled"] is True
        assert seen["lost"] is not None
        assert seen["lost"].reason == "fence"
        assert worker.stats.stale_commits == 1
        assert worker.stats.done == 0
        assert replies(outbox, task_id) == []
        other.finish(task_id, "w2", taken.fence, {"by": "w2"})
    finally:
        other_db.close()
    body = only_reply(outbox, task_id)
    assert (body["status"], body["result"], body["fence"]) == ("done", {"by": "w2"}, 2)


def test_worker_commit_after_lease_expiry_is_refused_even_unclaimed(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock
) -> None:
    task_id = submit(tasks, clock)

    def outlives_its_lease(task: Task) -> str:
        clock.advance(LEASE_S + 1)
        return "late"

    worker = make_worker(tasks, outlives_its_lease)
    worker.run_once()
    assert worker.stats.stale_commits == 1
    assert replies(outbox, task_id) == []
    assert state(tasks, task_id) == "running"  # the next claim reconciles it


def test_worker_renewal_keeps_a_long_handler_alive(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock
) -> None:
    task_id = submit(tasks, clock)
    worker: Worker

    def long_handler(task: Task) -> str:
        first_lease = task.lease_until
        clock.advance(LEASE_S - 1)
        assert worker.renew_leases() == 1
        assert task.lease_until == clock.now() + LEASE_S
        clock.advance(LEASE_S - 1)  # past the first lease, within the renewed one
        assert clock.now() > first_lease
        return "finished"

    worker = make_worker(tasks, long_handler)
    worker.run_once()
    assert only_reply(outbox, task_id)["status"] == "done"
    assert worker.stats.renewals == 1


def test_worker_renews_in_the_background(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock
) -> None:
    task_id = submit(tasks, clock)
    worker: Worker

    def waits_for_a_renewal(task: Task) -> float:
        clock.advance(LEASE_S - 1)
        wait_until(lambda: worker.stats.renewals >= 1)
        return task.lease_until

    worker = make_worker(tasks, waits_for_a_renewal, renew_every_s=0.01)
    worker.run_once()
    body = only_reply(outbox, task_id)
    assert body["status"] == "done"
    assert body["result"] >= clock.now() + LEASE_S - 1


# -- configuration ------------------------------------------------------------------------


def test_worker_config_is_frozen_and_strict_about_fields() -> None:
    config = WorkerConfig(owner="w1")
    assert (config.batch, config.renew_every_s) == (DEFAULT_BATCH, None)
    with pytest.raises(ValidationError):
        config.batch = 2  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"WorkerConfig\.lease_s"):
        WorkerConfig(owner="w1", lease_s=3)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"WorkerConfig.owner: .*; WorkerConfig.batch: "):
        WorkerConfig(owner="", batch=0)
    with pytest.raises(ConfigError, match=r"WorkerConfig\.call_timeout_s"):
        WorkerConfig(owner="w1", call_timeout_s=float("inf"))


def test_worker_refuses_renewals_slower_than_the_lease(tasks: TaskStore) -> None:
    with pytest.raises(ConfigError, match="must be shorter than the lease"):
        make_worker(tasks, sample.ok, renew_every_s=LEASE_S)
    assert make_worker(tasks, sample.ok).renew_every_s == LEASE_S / 3


def test_worker_refuses_a_bad_handler_spec(tasks: TaskStore) -> None:
    with pytest.raises(ConfigError, match="not found"):
        make_worker(tasks, "tests.support.nope:ok")


def test_worker_hits_its_crash_points_in_order(
    tasks: TaskStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    submit(tasks, clock)
    names: list[str] = []
    monkeypatch.setattr(crashpoints, "hit", names.append)
    make_worker(tasks, sample.ok).run_once()
    assert [n for n in names if n.startswith("worker.") or n.startswith("store.finish")] == [
        "worker.after_claim",
        "worker.after_effect",
        "store.finish.before_commit",
        "store.finish.after_commit",
        "worker.after_finish",
    ]


def test_worker_does_not_hit_after_finish_when_the_commit_is_refused(
    tasks: TaskStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    submit(tasks, clock)
    names: list[str] = []
    monkeypatch.setattr(crashpoints, "hit", names.append)

    def outlives_its_lease(task: Task) -> str:
        clock.advance(LEASE_S + 1)
        return "late"

    make_worker(tasks, outlives_its_lease).run_once()
    assert "worker.after_effect" in names
    assert "worker.after_finish" not in names


# -- run / stop ---------------------------------------------------------------------------


def start_run(worker: Worker, stop: threading.Event) -> threading.Thread:
    runner = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    runner.start()
    return runner


def test_worker_run_processes_until_stopped(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock
) -> None:
    ids = [submit(tasks, clock, message_id=f"m{i}") for i in range(3)]
    stop = threading.Event()
    worker = make_worker(tasks, sample.ok, idle_poll_s=0.01)
    runner = start_run(worker, stop)
    wait_until(lambda: worker.stats.done == 3)
    stop.set()
    runner.join(WAIT_S)
    assert not runner.is_alive()
    assert all(state(tasks, i) == "done" for i in ids)
    assert all(len(replies(outbox, i)) == 1 for i in ids)


def test_worker_run_returns_at_once_when_idle_and_stopped(tasks: TaskStore) -> None:
    stop = threading.Event()
    worker = make_worker(tasks, sample.ok, idle_poll_s=WAIT_S * 10)
    runner = start_run(worker, stop)
    stop.set()  # a wait on the stop event, not a 100 s sleep, so it returns at once
    runner.join(WAIT_S)
    assert not runner.is_alive()


def test_worker_stop_drains_the_running_handler_and_claims_nothing_more(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock
) -> None:
    first = submit(tasks, clock, message_id="m1")
    clock.advance(0.001)
    second = submit(tasks, clock, message_id="m2")
    entered, gate = threading.Event(), threading.Event()

    def gated(task: Task) -> str:
        entered.set()
        assert gate.wait(WAIT_S)
        return "drained"

    stop = threading.Event()
    worker = make_worker(tasks, gated, batch=1, idle_poll_s=0.01, grace_s=WAIT_S)
    runner = start_run(worker, stop)
    assert entered.wait(WAIT_S)
    stop.set()
    gate.set()
    runner.join(WAIT_S)
    assert not runner.is_alive()
    assert only_reply(outbox, first)["result"] == "drained"
    assert state(tasks, second) == "pending"
    assert worker.stats.claimed == 1


def test_worker_stop_abandons_a_handler_past_the_grace(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock
) -> None:
    task_id = submit(tasks, clock)
    entered = threading.Event()

    def stubborn(task: Task) -> str:
        entered.set()
        task.wait_cancelled(WAIT_S)
        return "too late"

    stop = threading.Event()
    worker = make_worker(tasks, stubborn, idle_poll_s=0.01, grace_s=0.05)
    runner = start_run(worker, stop)
    assert entered.wait(WAIT_S)
    stop.set()
    runner.join(WAIT_S)
    assert not runner.is_alive()
    row = tasks.get(task_id)
    assert row is not None
    assert row.state == "pending"
    assert row.error is not None
    assert "shutdown grace" in row.error
    assert replies(outbox, task_id) == []


def test_worker_stop_during_the_claim_still_runs_what_was_claimed(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    task_id = submit(tasks, clock)
    stop = threading.Event()
    claim = tasks.claim

    def claim_then_signal(owner: str, n: int = 1) -> list[ClaimedTask]:
        claimed = claim(owner, n)
        stop.set()  # SIGTERM lands while the claim runs
        return claimed

    monkeypatch.setattr(tasks, "claim", claim_then_signal)
    worker = make_worker(tasks, sample.ok)
    worker.run(stop)
    assert only_reply(outbox, task_id)["status"] == "done"
    assert worker.stats.claimed == worker.stats.done == 1


def test_worker_stop_grace_is_shared_by_the_whole_batch(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = submit(tasks, clock, message_id="m1")
    clock.advance(0.001)
    second = submit(tasks, clock, message_id="m2")
    stop = threading.Event()
    claim = tasks.claim

    def claim_then_signal(owner: str, n: int = 1) -> list[ClaimedTask]:
        claimed = claim(owner, n)
        stop.set()
        return claimed

    monkeypatch.setattr(tasks, "claim", claim_then_signal)
    worker = make_worker(tasks, sample.slow, batch=2, grace_s=0.05)
    worker.run(stop)
    assert (state(tasks, first), state(tasks, second)) == ("pending", "running")
    assert worker.stats.timeouts == 1  # the first was abandoned; the second never started
    assert replies(outbox, first) == replies(outbox, second) == []


def test_worker_handlers_never_run_inside_a_transaction(
    tasks: TaskStore, clock: FakeClock, db: Database
) -> None:
    submit(tasks, clock)
    seen: list[bool] = []

    def probe(task: Task) -> str:
        seen.append(db.conn.in_transaction)
        return "ok"

    make_worker(tasks, probe).run_once()
    assert seen == [False]


def test_worker_error_text_is_the_type_when_the_message_is_empty(
    tasks: TaskStore, clock: FakeClock
) -> None:
    task_id = submit(tasks, clock)

    def raises(task: Task) -> None:
        raise RetryableError("")

    worker = make_worker(tasks, raises)
    worker.run_once()
    row = tasks.get(task_id)
    assert row is not None
    assert (row.state, row.error) == ("pending", "RetryableError")


def test_worker_does_not_start_a_task_whose_claim_moved_on_while_it_waited(
    tasks: TaskStore, outbox: OutboxStore, clock: FakeClock, db: Database
) -> None:
    first = submit(tasks, clock, message_id="m1")
    clock.advance(0.001)
    second = submit(tasks, clock, message_id="m2")
    other_db = open_database(db.path)
    other = TaskStore(other_db, clock, TaskPolicy(lease_s=LEASE_S))
    ran: list[str] = []

    def frozen_past_its_lease(task: Task) -> str:
        ran.append(task.task_id)
        clock.advance(LEASE_S + 1)  # both leases run out; no renewal ran meanwhile
        other.claim("w2", 2)  # another worker takes both over (fence 2)
        return "stale result"

    worker = make_worker(tasks, frozen_past_its_lease, batch=2)
    try:
        assert worker.run_once() == 2
    finally:
        other_db.close()
    assert ran == [first]  # the second is seen lost before its handler starts
    assert worker.stats.stale_commits == 2  # its refused commit and the task not started
    assert worker.stats.done == 0
    assert replies(outbox, first) == replies(outbox, second) == []
