"""The hand-off of new tasks from the ingest's accept transaction to idle workers."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.errors import StoreBusy
from broker_adapter.handler.task import Task
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.stages.shared.handoff import Handoff, HandoffEndpoint
from broker_adapter.stages.shared.loop import CLAIM, LOOK, Handed
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.stages.worker.worker import Worker
from broker_adapter.store import AcceptItem, TaskStore
from broker_adapter.store.db import Database
from broker_adapter.store.task_types import TaskPolicy
from tests.support.handoff_script import ScriptedWait
from tests.support.store_script import open_any


def _item(i: int, clock: FakeClock) -> AcceptItem:
    return AcceptItem(
        "alice",
        Envelope.build(
            message_id=f"m{i}", sender="alice", payload={"i": i}, deadline=clock.now() + 600
        ),
    )


@pytest.fixture
def handoff() -> Iterator[Handoff]:
    h = Handoff(["w0", "w1"])
    yield h
    h.close()


class _Waiting:
    """A worker's wait on its endpoint, on a thread, until something comes."""

    def __init__(self, handoff: Handoff, endpoint: HandoffEndpoint, want: int) -> None:
        self.got: list[Handed] = []
        endpoint.wait(0.0, want)  # the first wait of an endpoint only says: look
        self._thread = threading.Thread(target=lambda: self.got.append(endpoint.wait(30, want)))
        self._thread.start()
        deadline = time.monotonic() + 10
        while endpoint.slot not in handoff.idle():  # until it sits in its cell
            assert time.monotonic() < deadline, "the worker never went idle"
            time.sleep(0.001)

    def result(self) -> Handed:
        self._thread.join(10)
        assert not self._thread.is_alive()
        return self.got[0]


# -- the protocol ----------------------------------------------------------------------------


def test_first_wait_looks_and_a_wait_that_gets_nothing_leaves_the_cell(
    handoff: Handoff,
) -> None:
    ep = handoff.endpoint(0)
    assert ep.wait(0.0, 4) == LOOK  # it has never looked: tasks may be waiting already
    assert ep.wait(0.0, 4) is None
    assert handoff.idle() == {}
    assert handoff.take(10) == []


def test_an_idle_worker_is_taken_and_gets_its_handles(handoff: Handoff) -> None:
    ep = handoff.endpoint(1)
    waiting = _Waiting(handoff, ep, want=2)
    assert handoff.idle() == {1: 2}
    assert handoff.take(5) == [(1, "w1", 2)]  # no more than it wants
    assert handoff.idle() == {}  # taken: nobody else hands it anything
    handoff.give(1, [("t1", 1), ("t2", 1)])
    assert waiting.result() == [("t1", 1), ("t2", 1)]


def test_take_takes_only_the_workers_it_needs(handoff: Handoff) -> None:
    first = _Waiting(handoff, handoff.endpoint(0), want=4)
    second = _Waiting(handoff, handoff.endpoint(1), want=4)
    assert handoff.take(3) == [(0, "w0", 3)]
    assert handoff.idle() == {1: 4}
    assert handoff.take(0) == []
    handoff.give(0, LOOK)
    assert handoff.take(9) == [(1, "w1", 4)]
    handoff.give(1, CLAIM)
    assert (first.result(), second.result()) == (LOOK, CLAIM)


def test_a_finishing_worker_is_taken_after_idle_ones_and_never_told_to_claim(
    handoff: Handoff,
) -> None:
    """``offer``: a worker about to commit its last batch can be handed the tasks of an
    accept meanwhile; idle workers come first, and ``CLAIM`` (tasks nobody was handed) is
    only for idle ones: the finishing commit's own claim finds those."""
    finishing = handoff.endpoint(0)
    assert finishing.wait(0.0, 1) == LOOK
    finishing.offer(3)
    assert handoff.idle() == {}  # not idle: committing
    waiting = _Waiting(handoff, handoff.endpoint(1), want=2)
    assert handoff.take(9, finishing=False) == [(1, "w1", 2)]
    handoff.give(1, CLAIM)
    assert waiting.result() == CLAIM
    assert handoff.take(9, finishing=False) == []
    assert handoff.take(9) == [(0, "w0", 3)]
    handoff.give(0, [("t1", 5)])
    assert finishing.withdraw() == [("t1", 5)]


def test_idle_workers_are_taken_before_finishing_ones(handoff: Handoff) -> None:
    finishing = handoff.endpoint(0)
    assert finishing.wait(0.0, 1) == LOOK
    finishing.offer(1)
    waiting = _Waiting(handoff, handoff.endpoint(1), want=1)
    assert handoff.take(1) == [(1, "w1", 1)]  # slot 1 before slot 0: it waits
    handoff.give(1, LOOK)
    assert waiting.result() == LOOK
    assert finishing.withdraw() is None  # nobody took it: it leaves its cell
    assert handoff.take(9) == []


def test_an_offer_reads_the_count_of_storing_commits_as_its_last_look(
    handoff: Handoff,
) -> None:
    """The commit after the offer claims what is stored by then; what comes later either
    finds the cell or moves the count, and the next wait looks."""
    ep = handoff.endpoint(0)
    ep.offer(1)
    assert ep.withdraw() is None
    assert ep.wait(0.0, 1) is None  # nothing stored since the offer: no look
    ep.offer(1)
    handoff.stored()  # an accept that had taken others before the offer
    assert ep.withdraw() is None
    assert ep.wait(0.0, 1) == LOOK


def test_a_commit_since_the_last_look_makes_the_wait_look_instead(handoff: Handoff) -> None:
    """The lost wake-up: tasks stored after the worker's last claim, before it sat down in
    its cell, are seen through the count of storing commits."""
    ep = handoff.endpoint(0)
    assert ep.wait(0.0, 1) == LOOK
    handoff.stored()
    assert ep.wait(0.0, 1) == LOOK
    assert handoff.idle() == {}  # it did not sit down
    assert ep.wait(0.0, 1) is None


def test_a_worker_taken_as_its_wait_ends_takes_the_message_first(handoff: Handoff) -> None:
    ep = handoff.endpoint(0)
    assert ep.wait(0.0, 3) == LOOK
    reader: Any = ep._reader
    real_poll = reader.poll

    def poll(timeout: float) -> bool:
        if poll.calls == 0 and handoff.idle():  # type: ignore[attr-defined]
            # The ingest takes the worker just as its wait times out.
            assert handoff.take(1) == [(0, "w0", 1)]
            handoff.give(0, [("t9", 4)])
            poll.calls += 1  # type: ignore[attr-defined]
            return False
        return bool(real_poll(timeout))

    poll.calls = 0  # type: ignore[attr-defined]
    reader.poll = poll
    assert ep.wait(0.0, 3) == [("t9", 4)]
    assert handoff.idle() == {}


def test_a_late_message_is_taken_before_the_worker_sits_down_again(handoff: Handoff) -> None:
    """A message that outlived the wait it answered (the ingest stuck past
    ``RECEIVE_TIMEOUT_S``) is the next wait's, and leaves no cell set behind."""
    ep = handoff.endpoint(0)
    assert ep.wait(0.0, 2) == LOOK
    handoff.give(0, [("t1", 3)])  # late: nobody took this worker now
    assert ep.wait(0.0, 2) == [("t1", 3)]
    assert handoff.idle() == {}
    waiting = _Waiting(handoff, ep, want=2)
    handoff.give(0, CLAIM)  # late again, while it sits in its cell
    assert waiting.result() == CLAIM
    assert handoff.idle() == {}  # it left its cell: the ingest does not take a busy worker


def test_a_dead_workers_pipe_is_reported_not_raised(
    handoff: Handoff, caplog: pytest.LogCaptureFixture
) -> None:
    ep = handoff.endpoint(0)
    ep.close()  # the process that held the reading end is gone
    with caplog.at_level(logging.WARNING, logger="broker_adapter.stages.handoff"):
        handoff.give(0, [("t1", 1)])
    assert "return at lease expiry" in caplog.text


def test_a_replacement_gets_a_new_pipe_and_an_empty_cell(handoff: Handoff) -> None:
    old = handoff.endpoint(0)
    waiting = _Waiting(handoff, old, want=2)
    handoff.endpoint(0)  # the pool replaces the process of slot 0
    assert handoff.idle() == {}
    assert waiting.result() is None  # the old pipe was closed: nothing more comes on it


# -- the ingest's accept with the hand-off ------------------------------------------------


def test_accept_claims_for_the_idle_worker_in_its_transaction(
    db: Database, clock: FakeClock, handoff: Handoff
) -> None:
    store = TaskStore(db, clock, TaskPolicy(lease_s=30))
    waiting = _Waiting(handoff, handoff.endpoint(0), want=8)
    results = handoff.accept(store, [_item(0, clock), _item(1, clock)])
    handles = waiting.result()
    assert isinstance(handles, list)
    assert [fence for _, fence in handles] == [1, 1]
    assert {r.task_id for r in results} == {task_id for task_id, _ in handles}
    rows = db.conn.execute("SELECT state, owner, attempts, fence, lease_until FROM tasks")
    assert {tuple(r) for r in rows} == {("running", "w0", 1, 1, clock.now() + 30)}
    claimed = TaskStore(db, clock).handed("w0", handles)
    assert [c.payload for c in claimed] == [{"i": 0}, {"i": 1}]
    assert {(c.owner, c.fence, c.attempt, c.lease_until) for c in claimed} == {
        ("w0", 1, 1, clock.now() + 30)
    }


def test_accept_with_nobody_idle_leaves_the_tasks_pending_and_counts_the_commit(
    db: Database, clock: FakeClock, handoff: Handoff
) -> None:
    store = TaskStore(db, clock)
    ep = handoff.endpoint(0)
    assert ep.wait(0.0, 1) == LOOK
    handoff.accept(store, [_item(0, clock)])
    assert [tuple(r) for r in db.conn.execute("SELECT state FROM tasks")] == [("pending",)]
    assert ep.wait(0.0, 1) == LOOK  # the next wait looks instead of sleeping on it


def test_a_duplicate_tells_the_taken_worker_to_look(
    db: Database, clock: FakeClock, handoff: Handoff
) -> None:
    """Nothing new stored: no claim in the transaction; the worker taken for it looks (and
    finds the first one, stored while nobody was idle)."""
    store = TaskStore(db, clock)
    handoff.accept(store, [_item(0, clock)])
    waiting = _Waiting(handoff, handoff.endpoint(0), want=1)
    handoff.accept(store, [_item(0, clock)])
    assert waiting.result() == LOOK
    assert [tuple(r) for r in db.conn.execute("SELECT state FROM tasks")] == [("pending",)]


def test_tasks_nobody_was_handed_go_to_a_worker_idle_by_then(
    db: Database, clock: FakeClock, handoff: Handoff, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = TaskStore(db, clock)
    waiting = _Waiting(handoff, handoff.endpoint(0), want=1)
    real_take = handoff.take
    takes: list[int] = []

    def take(needed: int, **kwargs: bool) -> list[tuple[int, str, int]]:
        takes.append(needed)
        # Before the transaction the worker was still busy; it is idle after the commit.
        return [] if len(takes) == 1 else real_take(needed, **kwargs)

    monkeypatch.setattr(handoff, "take", take)
    handoff.accept(store, [_item(0, clock), _item(1, clock)])
    assert takes == [2, 2]
    assert waiting.result() == CLAIM
    assert db.conn.execute("SELECT count(*) FROM tasks WHERE state = 'pending'").fetchone()[0] == 2


def test_a_failed_accept_still_answers_the_taken_worker(
    db: Database, clock: FakeClock, handoff: Handoff, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = TaskStore(db, clock)
    waiting = _Waiting(handoff, handoff.endpoint(0), want=1)

    def busy(*args: Any, **kwargs: Any) -> Any:
        raise StoreBusy("database is locked")

    monkeypatch.setattr(store, "accept_and_claim", busy)
    with pytest.raises(StoreBusy):
        handoff.accept(store, [_item(0, clock)])
    assert waiting.result() == LOOK


def test_handed_leaves_out_a_task_that_moved_on(store_target: str, clock: FakeClock) -> None:
    db = open_any(store_target)
    store = TaskStore(db, clock, TaskPolicy(lease_s=30))
    intake = store.accept_and_claim([_item(0, clock)], [("w0", 1)])
    handles = intake.claimed[0]
    assert len(handles) == 1
    clock.advance(31)  # w0 never took them up: the lease ran out, another worker claims
    assert [c.fence for c in store.claim("w1")] == [2]
    assert store.handed("w0", handles) == []
    assert store.handed("w1", handles) == []  # the fence is w0's, not w1's
    db.close()


def test_accept_and_claim_claims_in_the_order_asked(store_target: str, clock: FakeClock) -> None:
    with open_any(store_target) as db:
        store = TaskStore(db, clock)
        intake = store.accept_and_claim(
            [_item(i, clock) for i in range(3)], [("w0", 2), ("w1", 2), ("w2", 1)]
        )
        assert [len(h) for h in intake.claimed] == [2, 1, 0]
        assert store.accept_and_claim([], [("w0", 1)]).claimed == [[]]
        w0, w1, _ = intake.claimed
        handed = [store.handed("w0", w0), store.handed("w1", w1)]
        assert [[t.owner for t in claims] for claims in handed] == [["w0", "w0"], ["w1"]]


# -- the worker ----------------------------------------------------------------------------------


class _CountingStore(TaskStore):
    """A TaskStore that counts its looks (``has_work``) and claims."""

    looks = 0
    claims = 0

    def has_work(self) -> bool:
        self.looks += 1
        return super().has_work()

    def claim(self, owner: str, n: int = 1) -> list[Any]:
        self.claims += 1
        return super().claim(owner, n)


def _run_idle_worker(tasks: _CountingStore, script: list[str]) -> tuple[list[int], Worker]:
    """Run worker ``w1`` whose idle waits follow ``script``: ``"handed"`` accepts a task
    claimed for it and hands it over, ``"claim"`` accepts one and says claim, ``"look"``
    accepts one and says look, ``"timeout"`` returns nothing; then the worker is stopped
    (``"stop+handed"``: stopped in the same wait that hands a task)."""
    stop = threading.Event()
    handled: list[int] = []
    clock = tasks.clock
    waits: list[float] = []

    def step(timeout_s: float) -> Handed:
        waits.append(timeout_s)
        if len(waits) > len(script):
            stop.set()
            return None
        what = script[len(waits) - 1]
        item = _item(len(waits), clock)  # type: ignore[arg-type]
        if what.endswith("handed"):
            if what.startswith("stop"):
                stop.set()
            return tasks.accept_and_claim([item], [("w1", 4)]).claimed[0]
        if what in ("claim", "look"):
            tasks.accept([item])
            return CLAIM if what == "claim" else LOOK
        return None

    def handler(task: Task) -> dict[str, Any]:
        handled.append(task.payload["i"])
        return {}

    config = WorkerConfig(owner="w1", idle_poll_s=0.25, wake_poll_s=0.001)
    worker = Worker(config, tasks, handler, handoff=ScriptedWait(step))
    worker.run(stop)
    assert set(waits) == {0.25}  # the poll interval is only the wait's timeout
    return handled, worker


def test_handed_tasks_run_without_a_claim_of_the_workers_own(
    db: Database, clock: FakeClock
) -> None:
    tasks = _CountingStore(db, clock)
    handled, worker = _run_idle_worker(tasks, ["handed", "handed"])
    assert handled == [1, 2]
    assert tasks.claims == 1  # only run()'s first, before any wait
    assert (worker.stats.handed, worker.stats.claimed, worker.stats.done) == (2, 2, 2)


def _run_offering_worker(
    tasks: _CountingStore, handed: Callable[[int], Handed]
) -> tuple[list[Any], Worker, ScriptedWait]:
    """Run worker ``w1`` on the tasks already accepted; the withdraw after its ``n``-th
    finishing commit returns ``handed(n)`` (an accept took its offer, or not); its first
    idle wait stops it. Returns what happened in order (each handled task's ``i``, and
    ``"wait"`` for the idle wait), the worker and its scripted wait."""
    stop = threading.Event()
    events: list[Any] = []
    withdrawals = [0]

    def withdraw() -> Handed:
        withdrawals[0] += 1
        return handed(withdrawals[0])

    def step(timeout_s: float) -> Handed:
        events.append("wait")
        stop.set()
        return None

    def handler(task: Task) -> dict[str, Any]:
        events.append(task.payload["i"])
        return {}

    script = ScriptedWait(step, withdraw)
    worker = Worker(WorkerConfig(owner="w1", idle_poll_s=0.25), tasks, handler, handoff=script)
    worker.run(stop)
    return events, worker, script


def test_tasks_handed_while_the_worker_commits_run_without_a_claim_of_its_own(
    db: Database, clock: FakeClock
) -> None:
    """The worker offers before its finishing commit; an accept meanwhile claims a task for
    it, which it runs next, without a claim, a look or a wait of its own."""
    tasks = _CountingStore(db, clock)

    def handed(n: int) -> Handed:
        if n > 2:
            return None
        return tasks.accept_and_claim([_item(10 + n, clock)], [("w1", 4)]).claimed[0]

    tasks.accept([_item(0, clock)])
    events, worker, script = _run_offering_worker(tasks, handed)
    assert [e for e in events if e != "wait"] == [0, 11, 12]
    assert tasks.claims == 1  # run()'s first; the next two came with the offers
    assert script.offers == [worker.claim_size()] * 3
    assert (worker.stats.handed, worker.stats.done) == (2, 3)


def test_tasks_handed_during_a_finishing_commit_that_failed_still_run_next(
    db: Database, clock: FakeClock
) -> None:
    """The finishing commit fails (busy; its tasks come back at lease expiry) after an
    accept took the worker's offer: the tasks it was handed run straight away, before any
    idle wait."""

    class BusyOnce(_CountingStore):
        failed = False

        def settle_batch(self, *args: Any, **kwargs: Any) -> Any:
            if not self.failed:
                self.failed = True
                raise StoreBusy("database is locked")
            return super().settle_batch(*args, **kwargs)

    tasks = BusyOnce(db, clock, TaskPolicy(lease_s=30))

    def handed(n: int) -> Handed:
        if n > 1:
            return None
        return tasks.accept_and_claim([_item(11, clock)], [("w1", 4)]).claimed[0]

    tasks.accept([_item(0, clock)])
    events, _, _ = _run_offering_worker(tasks, handed)
    assert events[:2] == [0, 11]  # the handed task ran before any idle wait
    states = dict(db.conn.execute("SELECT message_id, state FROM tasks").fetchall())
    assert states["m11"] == "done"


def test_told_to_claim_the_worker_claims_without_looking_first(
    db: Database, clock: FakeClock
) -> None:
    tasks = _CountingStore(db, clock)
    handled, _ = _run_idle_worker(tasks, ["claim", "timeout"])
    assert handled == [1]
    assert tasks.claims == 2  # run()'s first, then the one the message asked for
    assert tasks.looks == 1  # only after the wait that timed out


def test_told_to_look_the_worker_looks_then_claims(db: Database, clock: FakeClock) -> None:
    tasks = _CountingStore(db, clock)
    handled, _ = _run_idle_worker(tasks, ["look"])
    assert handled == [1]
    assert (tasks.looks, tasks.claims) == (1, 2)


def test_tasks_handed_while_stopping_run_in_the_drain(db: Database, clock: FakeClock) -> None:
    tasks = _CountingStore(db, clock)
    handled, worker = _run_idle_worker(tasks, ["stop+handed"])
    assert handled == [1]
    assert worker.stats.done == 1
    states = db.conn.execute("SELECT state, count(*) FROM tasks GROUP BY state").fetchall()
    assert [tuple(r) for r in states] == [("done", 1)]
