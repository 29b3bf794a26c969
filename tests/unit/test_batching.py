"""The batched paths: one transaction settles many outcomes (each fenced) and claims ahead,
idle looks are reads, writers of one file in one process take turns, handler calls reuse a
thread until one is abandoned."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.errors import FencedError, StaleError, TaskCancelled
from broker_adapter.handler.task import Task
from broker_adapter.stages.shared.calls import call_handler
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.stages.worker.worker import Worker
from broker_adapter.store import ClaimedTask, FailOutcome, open_database
from broker_adapter.store.settle import Settlement
from tests.support.store_script import LEASE_S, T0, Stores, item, open_any, stores

WAIT_S = 10.0


@pytest.fixture
def s(store_target: str, clock: FakeClock) -> Iterator[Stores]:
    with open_any(store_target) as db:
        yield stores(db, clock)


def accept(s: Stores, clock: FakeClock, n: int) -> list[str]:
    ids: list[str] = []
    for i in range(n):
        (res,) = s.tasks.accept([item(f"m{i}")])
        assert res.task_id is not None
        ids.append(res.task_id)
        clock.advance(0.001)  # claim order follows not_before
    return ids


def done(c: ClaimedTask, result: object = "ok") -> Settlement:
    return Settlement(c.task_id, c.owner, c.fence, json.dumps(result), claimed=c)


def replies(s: Stores, task_id: str) -> list[dict[str, object]]:
    return [json.loads(r.body) for r in s.outbox.list() if r.task_id == task_id]


def test_claim_returns_a_batch_in_not_before_order(s: Stores, clock: FakeClock) -> None:
    ids = accept(s, clock, 5)
    claimed = s.tasks.claim("w1", 4)
    assert [c.task_id for c in claimed] == ids[:4]
    assert all(c.fence == 1 and c.attempt == 1 for c in claimed)
    assert s.tasks.counts()["running"] == 4


def test_settle_batch_commits_each_outcome_fenced_and_claims_the_next(
    s: Stores, clock: FakeClock
) -> None:
    ids = accept(s, clock, 5)
    first = s.tasks.claim("w1", 3)
    s.tasks.cancel(first[1].task_id)
    items = [
        done(first[0]),
        done(first[1]),
        Settlement(first[2].task_id, "w1", first[2].fence, None, "boom", retryable=False),
    ]
    batch = s.tasks.settle_batch(items, "w1", 10)
    results, ahead = batch.results, batch.claimed
    assert results[0] == f"r-{ids[0]}"
    assert isinstance(results[1], TaskCancelled)
    assert results[2] is FailOutcome.FAILED
    assert [c.task_id for c in ahead] == ids[3:]
    states = [s.tasks.get(i).state for i in ids]  # type: ignore[union-attr]
    assert states == ["done", "cancelled", "failed", "running", "running"]
    (reply,) = replies(s, ids[0])
    assert reply["status"] == "done"
    assert reply["result"] == "ok"
    assert reply["fence"] == 1
    assert len(replies(s, ids[1])) == len(replies(s, ids[2])) == 1


def test_settle_refuses_a_stale_item_and_writes_nothing_of_it(s: Stores, clock: FakeClock) -> None:
    (a, b) = accept(s, clock, 2)
    (ca, cb) = s.tasks.claim("w1", 2)
    clock.advance(LEASE_S + 1)  # both leases expire; w2 takes them back with fence 2
    assert [c.fence for c in s.tasks.claim("w2", 2)] == [2, 2]
    results = s.tasks.settle_batch([done(ca), done(cb)], "w1", 0).results
    assert all(isinstance(r, FencedError) for r in results)
    assert s.tasks.get(a).state == s.tasks.get(b).state == "running"  # type: ignore[union-attr]
    assert replies(s, a) == replies(s, b) == []


def test_settle_refuses_an_expired_lease_before_anyone_reclaims(
    s: Stores, clock: FakeClock
) -> None:
    (a,) = accept(s, clock, 1)
    (ca,) = s.tasks.claim("w1", 1)
    clock.advance(LEASE_S + 1)
    (result,) = s.tasks.settle_batch([done(ca)], "w1", 0).results
    assert isinstance(result, StaleError)
    assert result.reason == "lease_expired"
    assert replies(s, a) == []


def test_done_reply_is_the_same_with_or_without_the_claim(s: Stores, clock: FakeClock) -> None:
    """The reply encoded before the transaction (from the claim) equals the one built inside
    it from the row: same bytes, same hash."""
    (a, b) = accept(s, clock, 2)
    (ca, cb) = s.tasks.claim("w1", 2)
    plain = Settlement(cb.task_id, cb.owner, cb.fence, json.dumps({"x": 1}))
    s.tasks.settle_batch([done(ca, {"x": 1}), plain], "", 0)
    ra, rb = (s.outbox.get(f"r-{t}") for t in (a, b))
    assert ra is not None
    assert rb is not None
    body_a, body_b = json.loads(ra.body), json.loads(rb.body)
    for body, tid in ((body_a, a), (body_b, b)):
        assert body.pop("task_id") == tid
        assert body.pop("reply_id") == f"r-{tid}"
        assert body.pop("message_id") in ("m0", "m1")
    assert body_a == body_b


def test_has_work_sees_ready_tasks_and_expired_leases_only(s: Stores, clock: FakeClock) -> None:
    assert not s.tasks.has_work()
    accept(s, clock, 1)
    assert s.tasks.has_work()
    s.tasks.claim("w1", 1)
    assert not s.tasks.has_work()
    clock.advance(LEASE_S + 1)
    assert s.tasks.has_work()


def test_outbox_has_ready_and_mark_sent_and_claim(s: Stores, clock: FakeClock) -> None:
    assert not s.outbox.has_ready()
    with s.db.write("test") as c:
        for i in range(4):
            s.enqueue(
                c,
                reply_id=f"r{i}",
                task_id=None,
                principal="alice",
                message_id=f"m{i}",
                status="done",
                body={"i": i},
                now=clock.now() - 1 + i * 0.001,
            )
    assert s.outbox.has_ready()
    rows = s.outbox.claim("d1", 2)
    assert [r.reply_id for r in rows] == ["r0", "r1"]
    refused, ahead = s.outbox.mark_sent_and_claim(
        "d1", [("r0", rows[0].fence, "1-0"), ("r1", rows[1].fence + 1, "1-1")], 5
    )
    assert refused[0] is None
    assert isinstance(refused[1], FencedError)
    assert [r.reply_id for r in ahead] == ["r2", "r3"]
    assert s.outbox.get("r0").state == "sent"  # type: ignore[union-attr]
    assert s.outbox.get("r1").state == "sending"  # type: ignore[union-attr]
    assert not s.outbox.has_ready()


def test_writers_of_one_file_in_one_process_take_turns(tmp_path: Path) -> None:
    path = tmp_path / "turns.db"
    dbs = [open_database(path) for _ in range(3)]
    with dbs[0].write("setup") as c:
        c.execute("CREATE TABLE n (i INTEGER)")
    errors: list[BaseException] = []

    def write(db_index: int) -> None:
        try:
            for i in range(100):
                with dbs[db_index].write("test") as c:
                    c.execute("INSERT INTO n VALUES (?)", (i,))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert errors == []
    with dbs[0].read() as c:
        assert c.execute("SELECT count(*) FROM n").fetchone()[0] == 300
    for db in dbs:
        db.close()


def _task(clock: FakeClock, task_id: str = "t1") -> Task:
    claimed = ClaimedTask(
        task_id, "alice", "m1", "task", {}, 1, 3, 1, "w1", T0 + LEASE_S, T0 + 600, 0, None, None
    )
    return Task(claimed, clock=clock)


def test_handler_calls_reuse_a_thread_until_one_is_abandoned(clock: FakeClock) -> None:
    seen: list[threading.Thread] = []
    release = threading.Event()

    def where(task: Task) -> str:
        seen.append(threading.current_thread())
        return "ok"

    def stuck(task: Task) -> str:
        seen.append(threading.current_thread())
        release.wait(WAIT_S)
        return "late"

    assert call_handler(where, _task(clock), WAIT_S).value == "ok"
    assert call_handler(where, _task(clock), WAIT_S).value == "ok"
    assert seen[0] is seen[1] is not threading.current_thread()
    abandoned = call_handler(stuck, _task(clock), 0.05)
    assert abandoned.timed_out
    assert call_handler(where, _task(clock), WAIT_S).value == "ok"  # a fresh thread
    assert seen[3] is not seen[2]
    release.set()


def test_worker_skips_a_waiting_task_whose_lease_was_lost(s: Stores, clock: FakeClock) -> None:
    """A claimed task waiting its turn keeps its lease through renewals; when a renewal is
    refused (another worker took it over), the task is not started and nothing is written."""
    (a, b) = accept(s, clock, 2)
    ran: list[str] = []
    worker: Worker

    def takeover_of_the_next(task: Task) -> str:
        ran.append(task.task_id)
        clock.advance(LEASE_S + 1)
        s.tasks.claim("w2", 2)  # b's lease expired: w2 takes it (and re-takes a)
        assert worker.renew_leases() == 0  # a's and b's renewals are refused now
        return "ok"

    worker = Worker(WorkerConfig(owner="w1", batch=2), s.tasks, takeover_of_the_next)
    assert worker.run_once() == 2
    assert ran == [a]
    assert worker.stats.done == 0
    assert worker.stats.stale_commits == 2  # a's commit refused, b never started
    assert s.tasks.get(b).owner == "w2"  # type: ignore[union-attr]
    assert replies(s, a) == replies(s, b) == []
