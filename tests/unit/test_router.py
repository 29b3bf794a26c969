"""Named tasks: the envelope's ``task`` member, the ``Router``, and a worker serving one (on a
file-backed SQLite store and a FakeClock): routing, validation before any handler runs,
per-task settings, Retry-After, and lanes holding each task under its own lease."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from typing import Any

import pytest
from pydantic import BaseModel, Field

from broker_adapter.clock import FakeClock
from broker_adapter.errors import ConfigError, EnvelopeError, RetryableError
from broker_adapter.handler.router import RouteError, Router, validate_payload
from broker_adapter.handler.task import Task
from broker_adapter.protocol.envelope import TASK_NAME_MAX_BYTES, Envelope
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.stages.worker.worker import Worker
from broker_adapter.store import AcceptItem, Database, OutboxStore, TaskStore
from broker_adapter.store.inbox import Outcome
from broker_adapter.store.task_types import TaskPolicy
from tests.support import router_app

WAIT_S = 10.0


class Restart(BaseModel):
    server: str = Field(min_length=1)
    force: bool = False


class Resize(BaseModel):
    server: str
    cpus: int = Field(ge=1, le=64)


@pytest.fixture
def tasks(db: Database, clock: FakeClock) -> TaskStore:
    return TaskStore(db, clock, TaskPolicy(lease_s=30.0), rng=random.Random(7))


def submit(
    tasks: TaskStore,
    clock: FakeClock,
    payload: dict[str, Any],
    *,
    task: str | None = None,
    message_id: str = "m1",
    max_attempts: int = 3,
    deadline_in_s: float = 3600.0,
) -> str:
    env = Envelope.build(
        message_id=message_id,
        sender="agent-a",
        payload=payload,
        deadline=clock.now() + deadline_in_s,
        max_attempts=max_attempts,
        **({"task": task} if task else {}),
    )
    (result,) = tasks.accept([AcceptItem("agent-a", env)])
    assert result.task_id is not None
    return result.task_id


def reply_of(db: Database, task_id: str) -> dict[str, Any]:
    (row,) = [r for r in OutboxStore(db, FakeClock()).list() if r.task_id == task_id]
    body: dict[str, Any] = json.loads(row.body)
    return body


def state_of(db: Database, task_id: str) -> tuple[str, int]:
    row = db.fetch_one("SELECT state, attempts FROM tasks WHERE task_id = ?", (task_id,))
    assert row is not None
    return row["state"], row["attempts"]


class Calls:
    """What each handler was called with (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[str, Any]] = []

    def add(self, name: str, args: Any) -> None:
        with self.lock:
            self.seen.append((name, args))


def two_task_router(calls: Calls) -> Router:
    router = Router()

    @router.task("restart", payload=Restart)
    def restart(task: Task) -> dict[str, Any]:
        calls.add("restart", task.args)
        return {"restarted": task.args.server, "forced": task.args.force}

    @router.task("resize", payload=Resize)
    async def resize(task: Task) -> Resize:
        calls.add("resize", task.args)
        return Resize(server=task.args.server, cpus=task.args.cpus * 2)

    return router


# -- the envelope ----------------------------------------------------------------------


def _env(**fields: Any) -> Envelope:
    return Envelope.build(message_id="m", sender="a", payload={"x": 1}, deadline=1.9e9, **fields)


def test_the_task_member_is_optional_bounded_and_round_trips() -> None:
    assert _env().task is None
    assert "task" not in _env().to_dict()
    env = _env(task="ops.restart:v2")
    assert Envelope.from_json(env.to_json()).task == "ops.restart:v2"
    assert _env(task="t" * TASK_NAME_MAX_BYTES).task == "t" * TASK_NAME_MAX_BYTES
    with pytest.raises(EnvelopeError) as too_long:
        _env(task="t" * (TASK_NAME_MAX_BYTES + 1))
    assert (too_long.value.field, too_long.value.reason) == ("task", "bad_length")
    with pytest.raises(EnvelopeError) as empty:
        _env(task="")
    assert empty.value.reason == "bad_length"
    for bad in ("re start", "restart\n", "ré", "a/b"):
        with pytest.raises(EnvelopeError) as chars:
            _env(task=bad)
        assert chars.value.reason == "bad_chars", bad
    with pytest.raises(EnvelopeError) as typed:
        _env(task=7)
    assert typed.value.reason == "bad_type"


def test_the_fingerprint_covers_the_task_only_when_present() -> None:
    # A vector of docs/PROTOCOL.md: an envelope without ``task`` has no ``task`` in its content.
    plain = Envelope.from_json(
        b'{"deadline":1900000000,"message_id":"fp-2","payload":{"a":1},"sender":"alice"}'
    )
    assert plain.fingerprint() == "5971a934303b0c368a907ad5e9f8a59ab1994c08d22039060e306900484aeda7"
    named = plain.replace(task="restart")
    other = plain.replace(task="resize")
    assert len({plain.fingerprint(), named.fingerprint(), other.fingerprint()}) == 3
    assert named.content()["task"] == "restart"
    assert "task" not in plain.content()
    assert named.fingerprint() == named.replace(hops=3).fingerprint()  # hops are delivery


def test_the_same_message_id_with_another_task_name_is_a_conflict(
    tasks: TaskStore, clock: FakeClock
) -> None:
    env = Envelope.build(
        message_id="m1",
        sender="agent-a",
        payload={"server": "web1"},
        deadline=clock.now() + 60,
        task="restart",
    )
    first, again, other, unnamed = tasks.accept(
        [
            AcceptItem("agent-a", env),
            AcceptItem("agent-a", env),
            AcceptItem("agent-a", env.replace(task="resize")),
            AcceptItem("agent-a", env.replace(task=None)),
        ]
    )
    assert first.outcome is Outcome.STORED
    assert again.outcome is Outcome.DUPLICATE
    assert other.outcome is Outcome.CONFLICT
    assert unnamed.outcome is Outcome.CONFLICT
    row = tasks.db.fetch_one("SELECT task_name FROM tasks WHERE task_id = ?", (first.task_id,))
    assert row is not None
    assert row["task_name"] == "restart"


# -- the router ------------------------------------------------------------------------


def test_router_registration_is_checked() -> None:
    router = two_task_router(Calls())
    assert router.names == ["restart", "resize"]
    assert router.default is None
    with pytest.raises(ConfigError, match="twice"):
        router.task("restart")(lambda task: None)
    with pytest.raises(ConfigError, match="task name"):
        router.task("re start")(lambda task: None)
    with pytest.raises(ConfigError, match="needs a name"):
        router.task(None)(lambda task: None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="pydantic model"):
        router.task("x", payload=dict)(lambda task: None)  # type: ignore[arg-type]
    for bad in ({"call_timeout_s": 0}, {"max_attempts": 11}, {"concurrency": 0}):
        with pytest.raises(ConfigError):
            router.task("y", **bad)(lambda task: None)  # type: ignore[arg-type]
    router.task("z", default=True)(lambda task: None)
    with pytest.raises(ConfigError, match="default"):
        router.task("w", default=True)(lambda task: None)


def test_validate_payload_is_what_the_adapter_will_decide() -> None:
    router = two_task_router(Calls())
    assert validate_payload(router, "restart", {"server": "web1"}) == Restart(server="web1")
    assert router.validate_payload("resize", {"server": "a", "cpus": 2}).cpus == 2
    with pytest.raises(RouteError) as bad:
        validate_payload(router, "resize", {"server": "a", "cpus": 0})
    assert bad.value.reason == "invalid_payload"
    assert bad.value.errors[0]["loc"] == ["cpus"]
    with pytest.raises(RouteError) as unknown:
        validate_payload(router, "reboot", {})
    assert unknown.value.reason == "unknown_task"
    with pytest.raises(RouteError, match="no task name"):
        validate_payload(router, None, {})


def test_schemas_give_each_tasks_payload_and_result() -> None:
    schemas = {s["name"]: s for s in two_task_router(Calls()).schemas()}
    assert schemas["restart"]["payload"]["required"] == ["server"]
    assert schemas["restart"]["result"] == {}  # not annotated with a model
    assert schemas["resize"]["result"]["title"] == "Resize"  # its return annotation
    assert schemas["resize"]["payload"]["properties"]["cpus"]["maximum"] == 64


# -- a worker serving a router ---------------------------------------------------------


def test_two_names_each_with_its_model_and_the_handler_gets_it(
    tasks: TaskStore, clock: FakeClock, db: Database
) -> None:
    calls = Calls()
    a = submit(tasks, clock, {"server": "web1"}, task="restart", message_id="a")
    b = submit(tasks, clock, {"server": "db1", "cpus": 4}, task="resize", message_id="b")
    worker = Worker(WorkerConfig(owner="w1"), tasks, two_task_router(calls))
    assert worker.run_once() == 2
    assert sorted(calls.seen, key=lambda c: c[0]) == [
        ("resize", Resize(server="db1", cpus=4)),
        ("restart", Restart(server="web1")),
    ]
    assert reply_of(db, a)["result"] == {"restarted": "web1", "forced": False}
    assert reply_of(db, b)["result"] == {"server": "db1", "cpus": 8}


def test_an_unknown_name_and_an_invalid_payload_fail_once_without_a_handler_call(
    tasks: TaskStore, clock: FakeClock, db: Database
) -> None:
    calls = Calls()
    unknown = submit(tasks, clock, {"server": "web1"}, task="reboot", message_id="u")
    invalid = submit(tasks, clock, {"server": "db1", "cpus": "many"}, task="resize", message_id="i")
    unnamed = submit(tasks, clock, {"server": "web1"}, message_id="n")
    worker = Worker(WorkerConfig(owner="w1"), tasks, two_task_router(calls))
    assert worker.run_once() == 3
    assert calls.seen == []
    for task_id in (unknown, invalid, unnamed):
        assert state_of(db, task_id) == ("failed", 1)  # one attempt: never retried
        assert reply_of(db, task_id)["status"] == "failed"
    assert "unknown task 'reboot'" in reply_of(db, unknown)["error"]
    assert "'restart', 'resize'" in reply_of(db, unknown)["error"]
    error = reply_of(db, invalid)["error"]
    assert "cpus" in error
    assert "Resize" in error
    assert "valid integer" in error
    assert "no task name" in reply_of(db, unnamed)["error"]
    assert worker.stats.failed == 3
    assert worker.stats.retried == 0


def test_a_handler_of_one_still_serves_envelopes_without_a_name(
    tasks: TaskStore, clock: FakeClock, db: Database
) -> None:
    done = submit(tasks, clock, {"x": 1}, message_id="plain")
    named = submit(tasks, clock, {"x": 1}, task="other", message_id="named")
    worker = Worker(WorkerConfig(owner="w1"), tasks, lambda task: {"args": task.args})
    worker.run_once()
    assert reply_of(db, done)["result"] == {"args": None}
    assert state_of(db, named) == ("failed", 1)


def test_a_router_default_serves_envelopes_without_a_name(
    tasks: TaskStore, clock: FakeClock, db: Database
) -> None:
    task_id = submit(tasks, clock, {"seconds": 0}, message_id="d")
    Worker(WorkerConfig(owner="w1"), tasks, router_app.router).run_once()
    assert reply_of(db, task_id)["result"] == {"slept": 0.0, "attempt": 1}


def test_a_task_that_does_not_start_leaves_no_route_behind(
    tasks: TaskStore, clock: FakeClock, db: Database
) -> None:
    calls = Calls()
    submit(tasks, clock, {"server": "web1"}, task="restart", message_id="late", deadline_in_s=5.0)
    worker = Worker(WorkerConfig(owner="w1"), tasks, two_task_router(calls))
    (claimed,) = tasks.claim("w1", 1)
    clock.advance(10.0)  # its deadline passes before it starts
    task = worker.leases.keep(claimed)
    assert worker._prepare(task) is None
    assert worker.routes._routed == {}
    assert calls.seen == []


def test_per_task_timeout_and_attempts(tasks: TaskStore, clock: FakeClock, db: Database) -> None:
    router = Router()
    release = threading.Event()

    @router.task("slow", call_timeout_s=0.2)
    def slow(task: Task) -> None:
        release.wait(WAIT_S)

    @router.task("flaky", max_attempts=1)
    def flaky(task: Task) -> None:
        raise RetryableError("try again")

    slow_id = submit(tasks, clock, {}, task="slow", message_id="s", max_attempts=1)
    flaky_id = submit(tasks, clock, {}, task="flaky", message_id="f", max_attempts=5)
    try:
        Worker(WorkerConfig(owner="w1", call_timeout_s=30), tasks, router).run_once()
    finally:
        release.set()
    assert "within 0.200 s" in reply_of(db, slow_id)["error"]
    assert state_of(db, flaky_id) == ("failed", 1)
    assert "task 'flaky' allows 1" in reply_of(db, flaky_id)["error"]


def test_retry_after_is_honoured_within_the_deadline(
    tasks: TaskStore, clock: FakeClock, db: Database
) -> None:
    def limited(task: Task) -> None:
        raise RetryableError("429 from the model API", retry_after_s=120.0)

    later = submit(tasks, clock, {}, message_id="later")
    soon = submit(tasks, clock, {}, message_id="soon", deadline_in_s=60.0)
    Worker(WorkerConfig(owner="w1"), tasks, limited).run_once()
    row = db.fetch_one("SELECT state, not_before FROM tasks WHERE task_id = ?", (later,))
    assert row is not None
    assert row["state"] == "pending"
    assert row["not_before"] >= clock.now() + 120.0  # the backoff alone would be ~1 s
    assert state_of(db, soon) == ("failed", 1)
    assert "the deadline comes first" in reply_of(db, soon)["error"]


# -- concurrency ----------------------------------------------------------------------


def concurrent(tasks: TaskStore, handler: Any, n: int) -> Worker:
    return Worker(WorkerConfig(owner="w1", concurrency=n, idle_poll_s=0.01), tasks, handler)


def run_until(worker: Worker, done: Any) -> None:
    stop = threading.Event()
    runner = threading.Thread(target=worker.run, args=(stop,))
    runner.start()
    try:
        deadline = time.monotonic() + WAIT_S * 3
        while not done() and time.monotonic() < deadline:
            time.sleep(0.01)  # polling a condition with an explicit timeout
        assert done()
    finally:
        stop.set()
        runner.join(WAIT_S)


def test_a_batch_runs_its_async_calls_together(
    tasks: TaskStore, clock: FakeClock, db: Database
) -> None:
    async def waits(task: Task) -> None:
        await asyncio.sleep(0.5)

    for i in range(8):
        submit(tasks, clock, {}, message_id=f"m{i}")
    worker = concurrent(tasks, waits, 8)
    assert worker.claim_size() == 8  # one task per slot before any call was timed
    started = time.monotonic()
    assert worker.run_once() == 8
    assert time.monotonic() - started < 2.0  # 8 x 0.5 s one after another: 4 s
    assert tasks.counts()["done"] == 8
    assert worker.claim_size() == 8  # a slow call: one per slot


def test_the_per_task_concurrency_limit_holds_under_load(
    tasks: TaskStore, clock: FakeClock, db: Database
) -> None:
    router = Router()
    lock = threading.Lock()
    running = {"limited": 0, "free": 0}
    most = {"limited": 0, "free": 0}

    async def track(name: str) -> None:
        with lock:
            running[name] += 1
            most[name] = max(most[name], running[name])
        await asyncio.sleep(0.05)
        with lock:
            running[name] -= 1

    @router.task("limited", concurrency=2)
    async def limited(task: Task) -> None:
        await track("limited")

    @router.task("free")
    async def free(task: Task) -> None:
        await track("free")

    for i in range(16):
        submit(tasks, clock, {}, task="limited", message_id=f"l{i}")
        submit(tasks, clock, {}, task="free", message_id=f"f{i}")
    run_until(concurrent(tasks, router, 8), lambda: tasks.counts().get("done", 0) == 32)
    assert most["limited"] == 2  # held, and reached
    assert most["free"] > 2  # the other task's calls were not held by it


def test_each_call_holds_its_task_under_its_own_lease(
    tasks: TaskStore, clock: FakeClock, db: Database
) -> None:
    started = threading.Semaphore(0)
    go = threading.Event()
    lost: dict[str, bool] = {}

    async def waits(task: Task) -> dict[str, Any]:
        started.release()
        while not go.is_set() and not task.cancelled():  # noqa: ASYNC110 - two things to watch
            await asyncio.sleep(0.01)
        lost[task.message_id] = task.stop_reason == "lease_lost"
        return {"owner": task.owner}

    ids = [submit(tasks, clock, {}, message_id=f"m{i}") for i in range(4)]
    worker = concurrent(tasks, waits, 4)
    stop = threading.Event()
    runner = threading.Thread(target=worker.run, args=(stop,))
    runner.start()
    try:
        for _ in ids:
            assert started.acquire(timeout=WAIT_S)
        assert tasks.counts()["running"] == 4
        # Another worker takes one task over (its lease is gone): only that one stops.
        row = db.fetch_one("SELECT task_id, owner FROM tasks WHERE message_id = 'm2'")
        assert row is not None
        with db.write("steal") as c:
            c.execute(
                "UPDATE tasks SET owner = 'thief', fence = fence + 1 WHERE task_id = ?",
                (row["task_id"],),
            )
        assert worker.renew_leases() == 3
        deadline = time.monotonic() + WAIT_S
        while "m2" not in lost and time.monotonic() < deadline:
            time.sleep(0.01)  # polling a condition with an explicit timeout
        assert lost == {"m2": True}
        go.set()
        deadline = time.monotonic() + WAIT_S
        while tasks.counts().get("done", 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # polling a condition with an explicit timeout
    finally:
        go.set()
        stop.set()
        runner.join(WAIT_S)
    assert {m: v for m, v in lost.items() if m != "m2"} == {"m0": False, "m1": False, "m3": False}
    assert tasks.counts().get("done", 0) == 3
    assert state_of(db, ids[2])[0] == "running"  # the thief's now


def test_status_counts_tasks_by_name_once_one_has_a_name(
    tasks: TaskStore, clock: FakeClock, db: Database
) -> None:
    from broker_adapter.app.ops import collect_status, format_status

    submit(tasks, clock, {}, message_id="plain")
    assert "by_task" not in collect_status(db.path, None, "ba")
    submit(tasks, clock, {"server": "web1"}, task="restart", message_id="r1")
    submit(tasks, clock, {"server": "web1"}, task="restart", message_id="r2")
    report = collect_status(db.path, None, "ba")
    assert report["by_task"] == {"": {"pending": 1}, "restart": {"pending": 2}}
    assert "task        restart: pending 2" in format_status(report)


def test_the_reconciler_uses_the_effect_of_each_tasks_own_handler(tasks: TaskStore) -> None:
    from dataclasses import replace

    from broker_adapter.handler.effects import effect_spec
    from broker_adapter.stages.reconcile.reconciler import Reconciler
    from broker_adapter.store.effects import EffectsStore
    from broker_adapter.store.task_types import ClaimedTask

    charge = effect_spec(router_app.charge)
    assert charge is not None
    other = replace(charge, action="refund")
    reconciler = Reconciler(EffectsStore(tasks.tx), other, "r1", by_task={"charge": charge})
    claimed = ClaimedTask(
        "t", "agent-a", "m", "task", {}, 1, 3, 1, "w", 0.0, 1.0, 0, None, None, task_name="charge"
    )
    assert reconciler.spec_of(claimed) is charge
    assert reconciler.spec_of(replace(claimed, task_name="other")) is other


def test_both_databases_keep_the_task_name_and_refuse_another(store_target: str) -> None:
    from tests.support.store_script import open_any

    db = open_any(store_target)
    try:
        store = TaskStore(db, FakeClock(1_000_000.0))
        env = Envelope.build(
            message_id="m1",
            sender="agent-a",
            payload={"server": "web1"},
            deadline=1_000_600.0,
            task="restart",
        )
        (stored,) = store.accept([AcceptItem("agent-a", env)])
        (other,) = store.accept([AcceptItem("agent-a", env.replace(task="resize"))])
        assert other.outcome is Outcome.CONFLICT
        (claimed,) = store.claim("w1", 1)
        assert claimed.task_id == stored.task_id
        assert claimed.task_name == "restart"
    finally:
        db.close()
