"""``backoff.run_until_stopped``: the loop of the ingest and the receiver; and
``backoff.call_until_stopped``: a stage's set-up against a server that may be down."""

from __future__ import annotations

import threading

import pytest
import tenacity

from broker_adapter.backoff import call_until_stopped, run_until_stopped
from broker_adapter.errors import RedisUnavailable, StoreError


def test_ticks_run_until_stop_and_backoff_restarts_after_a_success() -> None:
    """Failures back off (without real waiting here); a success after a backoff ends the
    policy's run, so the next failure is attempt 1 again, not attempt 3."""
    stop = threading.Event()
    script = ["fail", "fail", "ok", "ok", "fail", "ok", "stop"]
    done: list[str] = []
    attempts: list[int] = []
    slept: list[float] = []

    def tick() -> None:
        step = script[len(done)]
        done.append(step)
        if step == "fail":
            raise RedisUnavailable("connection reset")
        if step == "stop":
            stop.set()

    def note(state: tenacity.RetryCallState) -> None:
        attempts.append(state.attempt_number)

    run_until_stopped(stop, tick, before_sleep=note, sleep=slept.append)
    assert done == script
    assert attempts == [1, 2, 1]
    assert len(slept) == 3
    assert all(0 <= s <= 5.0 for s in slept)


def test_a_stop_during_the_backoff_returns() -> None:
    stop = threading.Event()
    calls: list[int] = []

    def tick() -> None:
        calls.append(1)
        raise RedisUnavailable("down")

    run_until_stopped(stop, tick, sleep=lambda _s: stop.set())
    assert calls == [1]


def test_a_failure_that_is_not_transient_ends_the_loop() -> None:
    stop = threading.Event()

    def tick() -> None:
        raise StoreError("disk I/O error")

    with pytest.raises(StoreError, match="disk I/O error"):
        run_until_stopped(stop, tick, sleep=lambda _s: None)


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
