"""The log formats (``--log-format text|json``) and the task transition lines: one per
transition, with the task's ids as fields, rendered by both formats; never a payload."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from typing import Any

import pytest

from broker_adapter.app.cli import build_parser
from broker_adapter.app.logs import JsonFormatter, TextFormatter, fields_of
from broker_adapter.clock import FakeClock
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.reply import reply_id_for
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.stages.worker.worker import Worker
from broker_adapter.store import AcceptItem, TaskStore
from broker_adapter.store.effects import EffectsStore
from broker_adapter.store.task_types import TaskPolicy
from tests.support import handlers as sample
from tests.support.store_script import open_any

MARKER = "payload-marker-7f3c"
LEASE_S = 30.0


@pytest.fixture
def tasks(store_target: str, clock: FakeClock) -> Iterator[TaskStore]:
    """The task store on SQLite and on PostgreSQL: each backend logs the same lines."""
    with open_any(store_target) as db:
        yield TaskStore(db, clock, TaskPolicy(lease_s=LEASE_S), rng=random.Random(3))


def _item(clock: FakeClock, message_id: str, payload: dict[str, Any], attempts: int = 3) -> Any:
    env = Envelope.build(
        message_id=message_id,
        sender="agent-a",
        payload=payload,
        deadline=clock.now() + 3600,
        max_attempts=attempts,
    )
    return AcceptItem("agent-a", env)


def _lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The transition records as their fields."""
    return [fields_of(r) for r in caplog.records if r.name == "broker_adapter.tasks"]


def _all_text(caplog: pytest.LogCaptureFixture) -> str:
    text, js = TextFormatter(), JsonFormatter()
    return "\n".join(text.format(r) + "\n" + js.format(r) for r in caplog.records)


def test_text_and_json_render_the_fields_and_the_traceback() -> None:
    log = logging.getLogger("broker_adapter.test")
    try:
        raise KeyError("boom")
    except KeyError as exc:
        record = log.makeRecord(
            log.name,
            logging.ERROR,
            __file__,
            1,
            "task %s failed",
            ("t1",),
            (type(exc), exc, exc.__traceback__),
            extra={"task_id": "t1", "fence": 2, "detail": "a b"},
        )
    text = TextFormatter().format(record)
    first = text.splitlines()[0]
    assert first.endswith(
        'ERROR broker_adapter.test: task t1 failed task_id=t1 fence=2 detail="a b"'
    )
    assert text.count("Traceback (most recent call last)") == 1
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "task t1 failed"
    assert (line["level"], line["logger"], line["task_id"], line["fence"]) == (
        "ERROR",
        "broker_adapter.test",
        "t1",
        2,
    )
    assert line["ts"].endswith("Z")
    assert "KeyError: 'boom'" in line["exc"]


def test_log_format_is_a_flag_and_a_variable_of_run_and_receive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = ["run", "--redis", "redis://127.0.0.1:1/0", "--db", "a.db", "--handler", "m:f"]
    assert build_parser().parse_args(base).log_format == "text"
    monkeypatch.setenv("BA_LOG_FORMAT", "json")
    assert build_parser().parse_args(base).log_format == "json"
    receive = [
        "receive",
        "--redis",
        "redis://x",
        "--db",
        "r.db",
        "--principal",
        "p",
        "--keyring",
        "k",
        "--log-format",
        "text",
    ]
    assert build_parser().parse_args(receive).log_format == "text"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--log-format", "xml"])


def test_every_transition_of_a_task_is_one_line_with_its_ids(
    tasks: TaskStore, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="broker_adapter")
    (ok,) = tasks.accept([_item(clock, "m-ok", {"secret": MARKER})])
    (flaky,) = tasks.accept([_item(clock, "m-flaky", {"ok_on_attempt": 2, "m": MARKER})])
    assert ok.task_id is not None
    assert flaky.task_id is not None
    worker = Worker(WorkerConfig(owner="w1"), tasks, sample.flaky)
    while worker.run_once():
        clock.advance(10)  # past the retry's backoff
    lines = _lines(caplog)
    by_task = {
        tid: [
            (x["transition"], x.get("state"), x.get("attempt"))
            for x in lines
            if x["task_id"] == tid
        ]
        for tid in (ok.task_id, flaky.task_id)
    }
    # m-ok's handler sees attempt 1 < 2: a retry first as well, then both are done
    for tid in (ok.task_id, flaky.task_id):
        assert by_task[tid] == [
            ("accepted", "pending", None),
            ("claimed", "running", 1),
            ("retry", "pending", 1),
            ("claimed", "running", 2),
            ("done", "done", 2),
        ]
    done = next(x for x in lines if x["transition"] == "done" and x["task_id"] == ok.task_id)
    assert done["message_id"] == "m-ok"
    assert done["principal"] == "agent-a"
    assert done["reply_id"] == reply_id_for(ok.task_id)
    assert done["owner"] == "w1"
    assert done["fence"] == 2
    assert done["duration_s"] >= 0
    assert MARKER not in _all_text(caplog)


def test_a_handler_exception_is_logged_with_its_traceback_and_ids(
    tasks: TaskStore, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="broker_adapter")
    (res,) = tasks.accept([_item(clock, "m-bad", {"v": 1}, attempts=1)])
    assert res.task_id is not None
    worker = Worker(WorkerConfig(owner="w1"), tasks, sample.always_fail)
    assert worker.run_once() == 1
    failure = next(r for r in caplog.records if r.levelno == logging.ERROR)
    line = json.loads(JsonFormatter().format(failure))
    assert (line["task_id"], line["message_id"], line["principal"], line["attempt"]) == (
        res.task_id,
        "m-bad",
        "agent-a",
        1,
    )
    assert "Traceback (most recent call last)" in line["exc"]
    assert "ValueError" in line["exc"]
    (failed,) = [x for x in _lines(caplog) if x["transition"] == "failed"]
    assert (failed["task_id"], failed["state"], failed["attempt"]) == (res.task_id, "failed", 1)


def test_the_take_backs_of_effects_and_cancel_requests_are_logged(
    tasks: TaskStore, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A lapsed lease after an effect started (``unknown``) and after a requested cancel
    (``cancelled``): each taken back once, each logged with why."""
    caplog.set_level(logging.INFO, logger="broker_adapter")
    fx = EffectsStore(tasks.tx)
    tasks.accept([_item(clock, "m1", {"v": 1}), _item(clock, "m2", {"v": 2})])
    started, requested = tasks.claim("w1", 2)
    fx.mark_effect_started(started.task_id, "w1", started.fence)
    fx.request_cancel(requested.task_id)
    clock.advance(LEASE_S + 1)
    assert tasks.reconcile() == {
        "expired": 0,
        "requeued": 0,
        "exhausted": 0,
        "unknown": 1,
        "cancelled": 1,
    }
    got = {
        x["task_id"]: (x["transition"], x["state"], x["detail"])
        for x in _lines(caplog)
        if x["transition"] in ("unknown", "cancelled")
    }
    assert got == {
        started.task_id: (
            "unknown",
            "unknown",
            "the holder's lease or deadline ran out after its effect started",
        ),
        requested.task_id: (
            "cancelled",
            "cancelled",
            "cancel requested; the handler did not end within the grace",
        ),
    }


def test_routine_transitions_cost_no_record_at_info(
    tasks: TaskStore, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """At the CLI's default level the happy path writes no transition line; leaving it
    (a duplicate, a conflict, a lease run out, a cancel) does."""
    caplog.set_level(logging.INFO, logger="broker_adapter")
    (first,) = tasks.accept([_item(clock, "m1", {"v": 1})])
    (dup,) = tasks.accept([_item(clock, "m1", {"v": 1})])
    (conflict,) = tasks.accept([_item(clock, "m1", {"v": 2})])
    assert first.task_id is not None
    (claim,) = tasks.claim("w1")
    clock.advance(LEASE_S + 1)
    (again,) = tasks.claim("w2")  # the reconcile in the claim takes the lease back first
    tasks.cancel(first.task_id)
    got = [(x["transition"], x.get("state"), x.get("owner")) for x in _lines(caplog)]
    assert got == [
        ("duplicate", None, None),
        ("conflict", None, None),
        ("lease_expired", "pending", "w1"),
        ("cancelled", "cancelled", None),
    ]
    assert _lines(caplog)[1]["reply_id"] == conflict.reply_id
    assert (claim.fence, again.fence) == (1, 2)
    assert dup.task_id == first.task_id
