"""``loop.run_stage``: the one loop of the five stages (steps, backoff, idle wait, drain);
and ``backoff.call_until_stopped``: a stage's set-up against a server that may be down.

Backoffs and waits are injected (``sleep``, ``wait``): nothing here waits for time to pass.
"""

from __future__ import annotations

import logging
import threading

import pytest

from broker_adapter.backoff import call_until_stopped
from broker_adapter.errors import RedisUnavailable, StoreBusy, StoreError
from broker_adapter.stages.shared.loop import run_stage

log = logging.getLogger("tests.run_loop")


def _attempts(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "backing off" in r.getMessage()]


def test_a_transient_failure_backs_off_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Failures back off (logged once per backoff, each counted); a success after a backoff
    ends the policy's run, so the next failure is attempt 1 again, not attempt 3."""
    stop = threading.Event()
    script = ["fail", "fail", "ok", "ok", "fail", "ok", "stop"]
    done: list[str] = []
    slept: list[float] = []
    seen: list[BaseException | None] = []

    def step() -> bool:
        what = script[len(done)]
        done.append(what)
        if what == "fail":
            raise RedisUnavailable("connection reset")
        if what == "stop":
            stop.set()
        return True

    with caplog.at_level(logging.INFO, logger=log.name):
        run_stage(stop, step, log=log, what="stage", on_backoff=seen.append, sleep=slept.append)
    assert done == script
    assert len(slept) == 3
    assert all(0 <= s <= 5.0 for s in slept)
    assert [type(e) for e in seen] == [RedisUnavailable] * 3
    lines = _attempts(caplog)
    assert len(lines) == 3
    assert [line.split("(")[1].split(")")[0] for line in lines] == [
        "attempt 1",
        "attempt 2",
        "attempt 1",
    ]
    assert all(line.startswith("stage: transient failure") for line in lines)


def test_the_stage_waits_after_a_step_that_found_nothing_only() -> None:
    stop = threading.Event()
    found = [True, False, True, False]
    events: list[str] = []

    def step() -> bool:
        did = found.pop(0)
        events.append(f"step {did}")
        if not found:
            stop.set()  # no wait after the last step: the loop is stopping
        return did

    run_stage(
        stop, step, log=log, what="stage", wait=lambda: events.append("wait"), sleep=lambda _s: None
    )
    assert events == ["step True", "step False", "wait", "step True", "step False"]


def test_a_failure_that_is_not_transient_ends_the_loop() -> None:
    stop = threading.Event()
    drained: list[int] = []

    def step() -> bool:
        raise StoreError("disk I/O error")

    with pytest.raises(StoreError, match="disk I/O error"):
        run_stage(
            stop,
            step,
            log=log,
            what="stage",
            pending=lambda: True,
            drain=lambda: drained.append(1),
            sleep=lambda _s: None,
        )
    assert not drained  # loudly: no drain either


def test_a_stop_during_the_backoff_returns() -> None:
    stop = threading.Event()
    calls: list[int] = []

    def step() -> bool:
        calls.append(1)
        raise RedisUnavailable("down")

    run_stage(stop, step, log=log, what="stage", sleep=lambda _s: stop.set())
    assert calls == [1]


def test_a_stop_during_a_failing_step_returns_without_a_backoff() -> None:
    stop = threading.Event()
    slept: list[float] = []

    def step() -> bool:
        stop.set()
        raise RedisUnavailable("down")

    run_stage(stop, step, log=log, what="stage", sleep=slept.append)
    assert slept == []


def test_once_stopped_the_work_taken_ahead_is_drained() -> None:
    """A stop during a step that took work ahead (2 batches): the drain runs while work is
    pending, with the stage's drain step (not the main step, and no wait)."""
    stop = threading.Event()
    ahead: list[str] = []
    events: list[str] = []

    def step() -> bool:
        events.append("step")
        ahead.extend(["a", "b"])
        stop.set()
        return False

    def drain() -> None:
        events.append("drain " + ahead.pop(0))

    run_stage(
        stop,
        step,
        log=log,
        what="stage",
        wait=lambda: events.append("wait"),
        pending=lambda: bool(ahead),
        drain=drain,
        sleep=lambda _s: None,
    )
    assert events == ["step", "drain a", "drain b"]


def test_a_stop_during_the_backoff_still_drains_what_was_taken() -> None:
    stop = threading.Event()
    ahead = ["a"]
    drained: list[str] = []

    def step() -> bool:
        raise StoreBusy("database is locked")

    run_stage(
        stop,
        step,
        log=log,
        what="stage",
        pending=lambda: bool(ahead),
        drain=lambda: drained.append(ahead.pop()),
        sleep=lambda _s: stop.set(),
    )
    assert drained == ["a"]


def test_a_transient_failure_in_the_drain_ends_it(caplog: pytest.LogCaptureFixture) -> None:
    """The work left is not retried by a stopping stage: it comes back by itself (leases
    run out, entries stay pending)."""
    stop = threading.Event()
    stop.set()
    tries: list[int] = []

    def drain() -> None:
        tries.append(1)
        raise RedisUnavailable("gone")

    with caplog.at_level(logging.WARNING, logger=log.name):
        run_stage(
            stop,
            lambda: True,
            log=log,
            what="stage",
            pending=lambda: True,
            drain=drain,
            sleep=lambda _s: None,
        )
    assert tries == [1]
    assert any("work taken ahead is left" in r.getMessage() for r in caplog.records)


def test_the_drain_defaults_to_the_step() -> None:
    stop = threading.Event()
    ahead = ["a", "b"]
    ran: list[str] = []

    def step() -> bool:
        if not stop.is_set():
            stop.set()
            return True
        ran.append(ahead.pop())
        return True

    run_stage(stop, step, log=log, what="stage", pending=lambda: bool(ahead))
    assert ran == ["b", "a"]


def test_a_set_up_call_is_retried_while_transient_and_its_result_returned() -> None:
    """As a cluster client whose seed node is restarting: ``connect`` fails at once
    (``RedisUnavailable``) twice, then succeeds; the stage gets the client, not an error."""
    stop = threading.Event()
    outcomes: list[object] = [RedisUnavailable("seed node down"), RedisUnavailable("again")]
    slept: list[float] = []

    def connect() -> str:
        if outcomes:
            raise outcomes.pop(0)  # type: ignore[misc]
        return "client"

    assert call_until_stopped(stop, connect, sleep=slept.append) == "client"
    assert len(slept) == 2


def test_a_set_up_call_gives_up_with_none_once_stopped_and_raises_a_real_error() -> None:
    stop = threading.Event()

    def down() -> str:
        raise RedisUnavailable("nothing answers")

    def stop_instead_of_waiting(_seconds: float) -> None:
        stop.set()

    assert call_until_stopped(stop, down, sleep=stop_instead_of_waiting) is None

    def broken() -> str:
        raise StoreError("not a broker_adapter database")

    with pytest.raises(StoreError):
        call_until_stopped(threading.Event(), broken, sleep=lambda _s: None)
