"""broker_adapter.testing as an application's own test suite uses it: the pytest plugin's
fixtures (a private redis-server, a running adapter for the application's router, a
client) and the in-process TaskRunner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from broker_adapter import Client, RequestFailed
from broker_adapter.testing import TaskRunner
from tests.plugin import user_app

HERE = Path(__file__).resolve().parent


def test_a_request_through_a_real_adapter(ba_adapter: Any, ba_client: Client) -> None:
    ba_adapter(app="user_app:router", app_dir=HERE)
    reply = ba_client.request("add", {"a": 2, "b": 3}, message_id="add-2-3", timeout_s=60)
    assert reply.result == {"total": 5}


def test_an_invalid_payload_fails_without_a_handler_call(
    ba_adapter: Any, ba_client: Client
) -> None:
    ba_adapter(app="user_app:router", app_dir=HERE)
    with pytest.raises(RequestFailed) as failed:
        ba_client.request("add", {"a": "two"}, message_id="add-bad", timeout_s=60)
    assert failed.value.reply.error is not None
    assert "b" in failed.value.reply.error


def test_the_task_runner_validates_and_retries_on_a_fake_clock() -> None:
    user_app.flaky_calls.clear()
    with TaskRunner(user_app.router) as runner:
        start = runner.clock.now()
        assert runner.run("add", {"a": 1, "b": 1}).result == {"total": 2}
        invalid = runner.run("add", {"a": 1})
        flaky = runner.run("flaky", {"fail_times": 2}, max_attempts=5)
        elapsed = runner.clock.now() - start
    assert invalid.status == "failed"
    assert flaky.status == "done"
    assert flaky.result == {"attempt": 3}
    assert user_app.flaky_calls == [1, 2, 3]
    assert elapsed >= 60  # two Retry-After waits of 30 s, on the fake clock
