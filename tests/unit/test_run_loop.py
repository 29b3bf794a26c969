"""``backoff.run_until_stopped``: the loop of the ingest and the receiver."""

from __future__ import annotations

import threading

import pytest
import tenacity

from broker_adapter.backoff import run_until_stopped
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
