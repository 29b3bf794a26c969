"""Handler loading, the Task a handler sees, and one bounded call (no store writes here)."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.errors import ConfigError, RetryableError, StaleError
from broker_adapter.handler.task import Task, TaskControl
from broker_adapter.protocol.idempotency import idempotency_key_for
from broker_adapter.stages.shared.calls import CallRun, RunOutcome, StopRun, call_handler
from broker_adapter.stages.shared.handlers import (
    ERROR_TEXT_MAX_CHARS,
    describe_error,
    is_retryable,
    load_handler,
)
from broker_adapter.store import ClaimedTask
from tests.support import handlers as sample

WAIT_S = 10.0


def claimed(clock: FakeClock, **overrides: object) -> ClaimedTask:
    fields: dict[str, object] = {
        "task_id": "t" * 32,
        "principal": "agent-a",
        "message_id": "m1",
        "kind": "task",
        "payload": {"x": 1},
        "attempt": 1,
        "max_attempts": 3,
        "fence": 1,
        "owner": "w1",
        "lease_until": clock.now() + 30,
        "deadline": clock.now() + 600,
        "hops": 0,
        "correlation_id": None,
        "parent_id": None,
    }
    fields.update(overrides)
    return ClaimedTask(**fields)  # type: ignore[arg-type]


@pytest.fixture
def task(clock: FakeClock) -> Task:
    return Task(claimed(clock), clock=clock)


@pytest.fixture
def scratch_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path for modules written by the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("ba_broken_mod", "ba_imports_missing"):
        sys.modules.pop(name, None)


# -- load_handler -------------------------------------------------------------------------


def test_load_handler_returns_sync_async_and_dotted_callables() -> None:
    assert load_handler("tests.support.handlers:ok") is sample.ok
    assert load_handler("tests.support.handlers:async_ok") is sample.async_ok
    assert load_handler(" tests.support.handlers:Namespace.ok ") is sample.Namespace.ok


@pytest.mark.parametrize(
    "spec", ["tests.support.handlers", ":ok", "tests.support.handlers:", "a b:c", "a..b:c", "m:x-y"]
)
def test_load_handler_rejects_bad_format(spec: str) -> None:
    with pytest.raises(ConfigError, match=r"malformed: expected 'package\.module:callable'"):
        load_handler(spec)


def test_load_handler_reports_missing_module() -> None:
    with pytest.raises(ConfigError, match=r"module 'tests\.support\.nope' not found"):
        load_handler("tests.support.nope:ok")


def test_load_handler_reports_a_module_that_fails_to_import(scratch_modules: Path) -> None:
    (scratch_modules / "ba_broken_mod.py").write_text("raise RuntimeError('bad config')\n")
    (scratch_modules / "ba_imports_missing.py").write_text("import ba_no_such_dependency\n")
    with pytest.raises(ConfigError, match=r"importing 'ba_broken_mod' failed: RuntimeError: bad"):
        load_handler("ba_broken_mod:f")
    with pytest.raises(ConfigError, match="importing 'ba_imports_missing' failed: ModuleNotFound"):
        load_handler("ba_imports_missing:f")


def test_load_handler_reports_missing_attribute() -> None:
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        load_handler("tests.support.handlers:nope")


def test_load_handler_reports_not_callable() -> None:
    with pytest.raises(ConfigError, match="'NOT_CALLABLE' is a dict, not callable"):
        load_handler("tests.support.handlers:NOT_CALLABLE")


def test_load_handler_reports_wrong_arity() -> None:
    with pytest.raises(
        ConfigError, match=r"must accept one positional argument .*\(task: 'Task', extra: 'str'\)"
    ):
        load_handler("tests.support.handlers:needs_two")


# -- errors -------------------------------------------------------------------------------


def test_is_retryable_accepts_the_class_and_the_attribute() -> None:
    assert is_retryable(RetryableError("x"))
    assert is_retryable(sample.UpstreamBusy("x"))
    assert not is_retryable(ValueError("x"))
    flagged = ValueError("x")
    flagged.retryable = "yes"  # type: ignore[attr-defined]
    assert not is_retryable(flagged)  # only ``True`` itself counts


def test_describe_error_is_type_and_message_capped() -> None:
    assert describe_error(ValueError("boom")) == "ValueError: boom"
    assert describe_error(KeyError()) == "KeyError"
    assert len(describe_error(ValueError("x" * 10_000))) == ERROR_TEXT_MAX_CHARS


# -- Task ---------------------------------------------------------------------------------


def test_task_exposes_the_claim(task: Task, clock: FakeClock) -> None:
    assert (task.task_id, task.principal, task.message_id) == ("t" * 32, "agent-a", "m1")
    assert (task.attempt, task.fence, task.owner, task.payload) == (1, 1, "w1", {"x": 1})
    assert task.idempotency_key == idempotency_key_for("agent-a", "m1")
    assert task.idempotency_key == "ba:" + hashlib.sha256(b"agent-a\x00m1").hexdigest()[:32]
    assert task.time_left_s() == pytest.approx(600)
    clock.advance(100)
    assert task.time_left_s() == pytest.approx(500)
    assert not task.cancelled()
    assert task.lease_lost is None
    assert task.stop_reason is None


def test_task_cancelled_asks_the_store_until_true(clock: FakeClock) -> None:
    answers = iter([False, True])
    calls = []

    def check() -> bool:
        calls.append(1)
        return next(answers)

    task = Task(claimed(clock), clock=clock, cancel_check=check)
    assert not task.cancelled()
    assert task.cancelled()
    assert task.cancelled()  # remembered: the store is not asked again
    assert len(calls) == 2
    assert task.stop_reason == "cancelled"
    assert task.wait_cancelled(0)


def test_task_lease_lost_sets_cancelled_and_keeps_the_first_reason(task: Task) -> None:
    refusal = StaleError(task.task_id, "fence")
    TaskControl(task).mark_lease_lost(refusal)
    TaskControl(task).mark_stopped("timeout")
    assert task.cancelled()
    assert task.lease_lost is refusal
    assert task.stop_reason == "lease_lost"


def test_task_note_renewed_only_moves_forward(task: Task) -> None:
    first = task.lease_until
    TaskControl(task).note_renewed(first + 10)
    TaskControl(task).note_renewed(first + 5)
    assert task.lease_until == first + 10


# -- call_handler -------------------------------------------------------------------------


def test_call_handler_returns_value(task: Task) -> None:
    outcome = call_handler(sample.ok, task, WAIT_S)
    assert outcome.ok
    assert outcome.value == {"echo": {"x": 1}, "attempt": 1}


def test_call_handler_captures_exceptions(task: Task) -> None:
    outcome = call_handler(sample.always_fail, task, WAIT_S)
    assert not outcome.ok
    assert isinstance(outcome.error, ValueError)


def test_call_handler_sync_timeout_abandons_and_signals_the_handler(task: Task) -> None:
    returned = threading.Event()

    def slow(t: Task) -> None:
        t.wait_cancelled(WAIT_S)
        returned.set()

    outcome = call_handler(slow, task, 0.05)
    assert outcome.timed_out
    assert not outcome.ok
    assert task.stop_reason == "timeout"
    assert returned.wait(WAIT_S)  # the abandoned handler saw cancelled() and ended


def test_call_handler_runs_async_handlers(task: Task) -> None:
    outcome = call_handler(sample.async_ok, task, WAIT_S)
    assert outcome.ok
    assert outcome.value == {"async": True, "echo": {"x": 1}}


def test_call_handler_async_timeout_cancels_the_coroutine(task: Task) -> None:
    seen: list[str] = []

    async def hang(t: Task) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    outcome = call_handler(hang, task, 0.05)
    assert outcome.timed_out
    assert seen == ["cancelled"]


def test_call_handler_own_timeout_error_is_an_error_not_a_timeout(task: Task) -> None:
    async def raises(t: Task) -> None:
        raise TimeoutError("upstream timed out")

    outcome = call_handler(raises, task, WAIT_S)
    assert not outcome.timed_out
    assert isinstance(outcome.error, TimeoutError)


def test_call_handler_on_stop_waits_grace_then_abandons(task: Task) -> None:
    stop = threading.Event()
    stop.set()
    outcome = call_handler(sample.slow, task, WAIT_S, stop=stop, grace_s=0.05)
    assert outcome.stopped
    assert task.stop_reason == "stopping"


def test_call_handler_on_stop_lets_a_quick_handler_finish(task: Task) -> None:
    stop = threading.Event()
    gate = threading.Event()

    def waits_for_gate(t: Task) -> str:
        stop.set()
        gate.wait(WAIT_S)
        return "finished"

    def release_after_stop() -> None:
        if stop.wait(WAIT_S):
            gate.set()

    releaser = threading.Thread(target=release_after_stop)
    releaser.start()
    outcome = call_handler(waits_for_gate, task, WAIT_S, stop=stop, grace_s=WAIT_S)
    releaser.join(WAIT_S)
    assert outcome.ok
    assert outcome.value == "finished"


# -- CallRun ------------------------------------------------------------------------------


def _tasks(clock: FakeClock, n: int) -> list[Task]:
    return [
        Task(claimed(clock, task_id=f"{i:032x}", message_id=f"m{i}"), clock=clock) for i in range(n)
    ]


def _drive(run: CallRun) -> list[RunOutcome]:
    """Supervise a run to its end, as a worker does."""
    out: list[RunOutcome] = []
    while not run.wait(run.supervise()):
        out.extend(run.take())
    out.extend(run.take())
    return out


def test_call_run_makes_the_calls_back_to_back_on_one_thread(clock: FakeClock) -> None:
    threads: list[int] = []

    def handler(t: Task) -> str:
        threads.append(threading.get_ident())
        return t.message_id

    tasks = _tasks(clock, 20)
    ended = _drive(CallRun(handler, tasks, lambda _t: WAIT_S))
    assert [e.outcome.value for e in ended] == [f"m{i}" for i in range(20)]
    assert [e.task for e in ended] == tasks
    assert len(set(threads)) == 1
    assert threads[0] != threading.get_ident()


def test_call_run_abandons_a_stuck_call_and_goes_on_with_the_rest(clock: FakeClock) -> None:
    release = threading.Event()

    def handler(t: Task) -> str:
        if t.message_id == "m1":
            release.wait(WAIT_S)  # ignores cancelled(): stuck past its timeout
            return "late"
        return t.message_id

    tasks = _tasks(clock, 4)
    ended = _drive(CallRun(handler, tasks, lambda t: 0.05 if t.message_id == "m1" else WAIT_S))
    release.set()
    by_task = {e.task.message_id: e.outcome for e in ended}
    assert by_task["m1"].timed_out
    assert tasks[1].stop_reason == "timeout"
    assert [by_task[m].value for m in ("m0", "m2", "m3")] == ["m0", "m2", "m3"]
    assert len(ended) == 4  # one outcome each: the stuck call's is its timeout


def test_call_run_prepare_skips_stops_and_fails(clock: FakeClock) -> None:
    def prepare(t: Task) -> float | None:
        if t.message_id == "m1":
            return None  # not to run (cancelled, expired ...)
        if t.message_id == "m3":
            raise StopRun
        return WAIT_S

    run = CallRun(lambda t: t.message_id, _tasks(clock, 6), prepare)
    ended = _drive(run)
    assert [e.outcome.value for e in ended] == ["m0", "m2"]
    assert (run.started, run.not_started) == (3, 3)

    def broken(t: Task) -> float:
        if t.message_id == "m2":
            raise RuntimeError("store down")
        return WAIT_S

    run = CallRun(lambda t: t.message_id, _tasks(clock, 4), broken)
    assert run.wait(WAIT_S)
    assert [e.outcome.value for e in run.take()] == ["m0", "m1"]  # what ended before it
    with pytest.raises(RuntimeError, match="store down"):
        run.take()
    assert run.take() == []


def test_call_run_halt_starts_nothing_more_and_drops_the_call_in_progress(
    clock: FakeClock,
) -> None:
    started = threading.Event()
    gate = threading.Event()

    def handler(t: Task) -> str:
        started.set()
        gate.wait(WAIT_S)
        return t.message_id

    run = CallRun(handler, _tasks(clock, 3), lambda _t: WAIT_S)
    assert started.wait(WAIT_S)
    run.halt()
    gate.set()
    assert run.wait(0)
    assert run.take() == []
    assert (run.started, run.not_started) == (1, 2)
