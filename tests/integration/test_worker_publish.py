"""Workers that publish their own replies, against a real redis-server.

The batch's commit writes the replies already claimed by the worker's publisher; right
after it they are published with the dispatcher's code, and marked sent (fenced) in the
next commit or a small transaction of their own. Redis trouble puts them back in line;
a stale publisher's marks are refused; the dispatcher stays the sweeper.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.backoff import Backoff
from broker_adapter.clock import FakeClock
from broker_adapter.errors import FencedError
from broker_adapter.handler.task import Task
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import connect
from broker_adapter.stages.dispatch.dispatcher import Dispatcher, DispatcherConfig
from broker_adapter.stages.dispatch.loss import RECHECK_AFTER_S, LossEvent
from broker_adapter.stages.shared.loop import CLAIM, Handed
from broker_adapter.stages.shared.publish import ReplyPublisher
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.stages.worker.worker import Worker
from broker_adapter.store import AcceptItem, OutboxStore, TaskStore, open_database
from broker_adapter.store.db import Database
from broker_adapter.store.outbox_types import OutboxPolicy
from broker_adapter.store.settle import SettledBatch, Settlement
from broker_adapter.store.task_types import TaskPolicy
from tests.support.handoff_script import ScriptedWait
from tests.support.redis_server import RedisServer, free_port
from tests.support.replies_script import entries_per_reply, reply_keyring

pytestmark = pytest.mark.integration

P = "alice"


def _submit(db: Database, clock: FakeClock, n: int, first: int = 0) -> list[str]:
    results = TaskStore(db, clock).accept(
        [
            AcceptItem(
                P,
                Envelope.build(
                    message_id=f"m{i}", sender=P, payload={"i": i}, deadline=clock.now() + 3600
                ),
            )
            for i in range(first, first + n)
        ]
    )
    return [str(r.task_id) for r in results]


def _echo(task: Task) -> dict[str, Any]:
    return {"i": task.payload["i"]}


def _worker(
    db: Database,
    clock: FakeClock,
    url: str | None,
    prefix: str,
    handler: Callable[[Task], Any] = _echo,
    *,
    outbox_policy: OutboxPolicy | None = None,
    task_lease_s: float = 30.0,
    **cfg: Any,
) -> Worker:
    config = WorkerConfig(owner="w1", prefix=prefix, **cfg)
    tasks = TaskStore(db, clock, TaskPolicy(lease_s=task_lease_s))
    return Worker(
        config,
        tasks,
        handler,
        outbox_policy=outbox_policy,
        keyring=reply_keyring(),
        redis_client=None if url is None else connect(url),
    )


def _dispatcher(url: str, db: Database, clock: FakeClock, prefix: str) -> Dispatcher:
    return Dispatcher(
        DispatcherConfig(prefix=prefix, owner="d1"),
        connect(url),
        OutboxStore(db, clock),
        keyring=reply_keyring(),
    )


@contextmanager
def _ops(db: Database) -> Iterator[list[str]]:
    """Record the name of every write transaction on ``db``."""
    seen: list[str] = []
    write = db.write

    def counting(op: str, **options: Any) -> Any:
        seen.append(op)
        return write(op, **options)

    db.write = counting  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        db.write = write  # type: ignore[method-assign]


def test_worker_without_redis_leaves_replies_to_the_dispatcher(
    db: Database, clock: FakeClock, prefix: str
) -> None:
    _submit(db, clock, 3)
    worker = _worker(db, clock, None, prefix)
    assert worker.publisher is None
    assert worker.run_once() == 3
    rows = OutboxStore(db, clock).list()
    assert {(r.state, r.owner, r.fence, r.attempts) for r in rows} == {("pending", None, 0, 0)}


def test_worker_publishes_its_replies_and_marks_them_sent(
    db: Database, clock: FakeClock, prefix: str, redis_server: RedisServer
) -> None:
    ids = _submit(db, clock, 3)
    d = _dispatcher(redis_server.url, db, clock, prefix)
    d.watch()  # a dispatcher's first look sets the epoch key (the runner does it first)
    worker = _worker(db, clock, redis_server.url, prefix)
    with _ops(db) as ops:
        assert worker.run_once() == 3
    assert ops == ["claim", "finish", "mark_sent"]
    rows = OutboxStore(db, clock).list()
    assert sorted(str(r.task_id) for r in rows) == sorted(ids)
    assert {(r.state, r.owner, r.fence, r.attempts) for r in rows} == {("sent", None, 1, 1)}
    assert all(r.sent_at == clock.now() and r.entry_id for r in rows)
    stream = Keys(prefix).replies(P)
    entries = entries_per_reply(redis_server.client(), stream)
    assert entries == {r.reply_id: 1 for r in rows}
    assert worker.publish_stats.published == 3
    assert d.step() == 0  # the dispatcher finds nothing to do
    assert entries_per_reply(redis_server.client(), stream) == entries


def test_marks_ride_on_the_next_batch_commit(
    db: Database, clock: FakeClock, prefix: str, redis_server: RedisServer
) -> None:
    """In ``run`` the replies of one batch are marked sent by the next batch's commit: no
    transaction of their own while work follows."""
    _submit(db, clock, 4)
    outbox = OutboxStore(db, clock)
    stop = threading.Event()
    seen: dict[int, set[tuple[str, str | None]]] = {}

    def handler(task: Task) -> dict[str, Any]:
        i = task.payload["i"]
        if i == 2:  # first task of the second batch: the first batch is published, unmarked
            seen[i] = {(r.state, r.owner) for r in outbox.list() if r.task_id != task.task_id}
        if i == 3:
            stop.set()
        return {"i": i}

    worker = _worker(db, clock, redis_server.url, prefix, handler, batch=2, batch_window_s=60)
    with _ops(db) as ops:
        worker.run(stop)
    assert seen[2] == {("sending", "w1-pub")}
    assert ops == ["claim", "finish", "finish", "mark_sent"]
    rows = outbox.list()
    assert {(r.state, r.fence) for r in rows} == {("sent", 1)}
    stream = Keys(prefix).replies(P)
    assert entries_per_reply(redis_server.client(), stream) == {r.reply_id: 1 for r in rows}
    assert worker.publish_stats.published == 4


def test_redis_unreachable_puts_replies_back_in_line_then_published_once(
    db: Database, clock: FakeClock, prefix: str, redis_server: RedisServer
) -> None:
    _submit(db, clock, 2)
    dead_url = f"redis://127.0.0.1:{free_port()}"
    policy = OutboxPolicy(backoff=Backoff(base_s=1.0, cap_s=1.0))
    worker = _worker(db, clock, dead_url, prefix, outbox_policy=policy, batch=2)
    assert worker.run_once() == 2
    outbox = OutboxStore(db, clock)
    rows = outbox.list()
    assert {(r.state, r.owner, r.attempts, r.fence) for r in rows} == {("pending", None, 1, 1)}
    assert all(r.last_error for r in rows)
    assert worker.publish_stats.failed == 2
    assert not outbox.has_ready()  # backing off
    # paused after the failure: the next batch's replies are left to the dispatcher at once
    _submit(db, clock, 1, first=2)
    assert worker.run_once() == 1
    late = [r for r in outbox.list() if r.reply_id not in {x.reply_id for x in rows}]
    assert [(r.state, r.fence) for r in late] == [("pending", 0)]
    clock.advance(1.0)
    d = _dispatcher(redis_server.url, db, clock, prefix)
    assert d.step() == 3
    final = outbox.list()
    assert {r.state for r in final} == {"sent"}
    stream = Keys(prefix).replies(P)
    assert entries_per_reply(redis_server.client(), stream) == {r.reply_id: 1 for r in final}


def test_stale_publisher_marks_are_refused_after_the_dispatcher_took_over(
    db: Database, clock: FakeClock, prefix: str, redis_server: RedisServer
) -> None:
    """The worker's publisher lease runs out between its publication and its mark: the
    dispatcher takes the rows (fence 2), finds them published, marks them; the worker's
    marks, carried by its next commit, are refused and write nothing."""
    _submit(db, clock, 4)
    outbox = OutboxStore(db, clock)
    policy = OutboxPolicy(lease_s=5.0)
    stop = threading.Event()
    took_over: list[int] = []

    def handler(task: Task) -> dict[str, Any]:
        i = task.payload["i"]
        if i == 2:  # the first batch is published, its marks wait for this batch's commit
            clock.advance(policy.lease_s + 1)  # the publisher lease ran out (not the tasks')
            with open_database(db.path) as other:
                took_over.append(_dispatcher(redis_server.url, other, clock, prefix).step())
        if i == 3:
            stop.set()
        return {"i": i}

    worker = _worker(
        db,
        clock,
        redis_server.url,
        prefix,
        handler,
        outbox_policy=policy,
        task_lease_s=300,
        batch=2,
        batch_window_s=60,
    )
    worker.run(stop)
    assert took_over == [2]
    assert worker.publish_stats.fenced == 2
    assert worker.publish_stats.published == 2  # the second batch's
    rows = outbox.list()
    assert sorted(r.fence for r in rows) == [1, 1, 2, 2]
    assert {r.state for r in rows} == {"sent"}
    stream = Keys(prefix).replies(P)
    assert entries_per_reply(redis_server.client(), stream) == {r.reply_id: 1 for r in rows}


def _settle_one_published(
    db: Database, clock: FakeClock, *, publish_lease_s: float
) -> tuple[TaskStore, SettledBatch]:
    """Submit one task, claim it as ``w1`` and settle it done with its reply written
    claimed by publisher ``w1-pub``."""
    tasks = TaskStore(db, clock)
    _submit(db, clock, 1)
    (claimed,) = tasks.claim("w1", 1)
    batch = tasks.settle_batch(
        [Settlement(claimed.task_id, "w1", claimed.fence, '{"ok":true}', claimed=claimed)],
        "w1",
        0,
        publish_as="w1-pub",
        publish_lease_s=publish_lease_s,
    )
    return tasks, batch


def test_settle_batch_refuses_a_stale_mark_and_writes_nothing_of_it(
    db: Database, clock: FakeClock
) -> None:
    tasks, batch = _settle_one_published(db, clock, publish_lease_s=5.0)
    (row,) = batch.replies
    assert (row.state, row.owner, row.fence, row.attempts) == ("sending", "w1-pub", 1, 1)
    assert row.lease_until == clock.now() + 5.0
    clock.advance(6.0)
    outbox = OutboxStore(db, clock)
    (taken,) = outbox.claim("d1", 10)
    assert taken.fence == 2
    late = tasks.settle_batch(
        [], "w1", 0, publish_as="w1-pub", sent=[(row.reply_id, 1, "1-0", 0.0)]
    )
    (refusal,) = late.marks
    assert isinstance(refusal, FencedError)
    after = outbox.get(row.reply_id)
    assert after is not None
    assert (after.state, after.owner, after.fence, after.entry_id) == ("sending", "d1", 2, None)
    with pytest.raises(ValueError, match="publish_as"):
        tasks.settle_batch([], "w1", 0, sent=[(row.reply_id, 1, "1-0", 0.0)])


def test_mark_committed_after_a_restart_alarm_is_put_back_in_line(
    db: Database, clock: FakeClock, prefix: str, fresh_redis: RedisServer, tmp_path: Path
) -> None:
    """A worker's mark can commit after the dispatcher's restart alarm requeued the lost
    window; the dispatcher looks at that window again and resends (a no-op where the
    record survived)."""
    d = _dispatcher(fresh_redis.url, db, clock, prefix)
    d.watch()
    _, batch = _settle_one_published(db, clock, publish_lease_s=30.0)
    outbox = OutboxStore(db, clock)
    pub = ReplyPublisher(
        connect(fresh_redis.url), outbox, Keys(prefix), "w1-pub", keyring=reply_keyring()
    )
    pubs = pub.publish(batch.replies)
    (row,) = batch.replies
    confirmed_at = clock.now()
    fresh_redis.restart()  # (AOF always: the entry survives; the window is requeued anyway)
    for _ in range(3):  # the first look may meet the dead connection
        try:
            watch = d.watch()
            break
        except Exception:  # noqa: BLE001 - RedisUnavailable on the stale connection
            continue
    assert watch.event is LossEvent.RESTART
    assert watch.requeued == 0  # the row was still 'sending'
    (mark,) = outbox.mark_sent_marks(
        "w1-pub", [(row.reply_id, 1, pubs[0].entry_id or "", confirmed_at)]
    )
    assert mark is None
    assert outbox.counts()["sent"] == 1
    clock.advance(RECHECK_AFTER_S)
    assert d.watch().requeued == 1
    assert outbox.counts()["pending"] == 1
    assert d.step() == 1
    assert d.stats.already_published == 1
    stream = Keys(prefix).replies(P)
    assert entries_per_reply(fresh_redis.client(), stream) == {row.reply_id: 1}


def _run_idle(
    db: Database,
    clock: FakeClock,
    redis_server: RedisServer,
    prefix: str,
    wake: Callable[[float], Handed],
    stop: threading.Event,
    *,
    batch_window_s: float,
) -> list[str]:
    """Run a publishing worker ``w1`` whose idle waits are ``wake`` until ``stop``; returns
    the write transactions it made, in order."""
    config = WorkerConfig(
        owner="w1", prefix=prefix, batch_window_s=batch_window_s, idle_poll_s=0.25
    )
    worker = Worker(
        config,
        TaskStore(db, clock),
        _echo,
        handoff=ScriptedWait(wake),
        keyring=reply_keyring(),
        redis_client=connect(redis_server.url),
    )
    with _ops(db) as ops:
        worker.run(stop)
    return ops


def test_idle_worker_keeps_its_marks_for_the_next_commit_within_the_window(
    db: Database, clock: FakeClock, prefix: str, redis_server: RedisServer
) -> None:
    """Between tasks, an idle worker holds its marks up to ``batch_window_s``: work that
    arrives meanwhile carries them in its commit (no transaction of their own)."""
    _submit(db, clock, 1)
    stop = threading.Event()
    waits: list[float] = []
    outbox = OutboxStore(db, clock)

    def wake(timeout_s: float) -> Handed:
        waits.append(timeout_s)
        if len(waits) == 1:  # idle after the first task: its reply is published, unmarked
            assert {(r.state, r.owner) for r in outbox.list()} == {("sending", "w1-pub")}
            _submit(db, clock, 1, first=1)
            return CLAIM
        stop.set()
        return None

    ops = _run_idle(db, clock, redis_server, prefix, wake, stop, batch_window_s=60)
    assert ops == ["claim", "finish", "accept", "claim", "finish", "mark_sent"]
    assert waits == [0.25, 0.25]
    rows = outbox.list()
    assert {(r.state, r.fence) for r in rows} == {("sent", 1)}
    stream = Keys(prefix).replies(P)
    assert entries_per_reply(redis_server.client(), stream) == {r.reply_id: 1 for r in rows}


def test_idle_worker_marks_alone_once_the_window_is_over(
    db: Database, clock: FakeClock, prefix: str, redis_server: RedisServer
) -> None:
    _submit(db, clock, 1)
    stop = threading.Event()
    waits: list[float] = []

    def wake(timeout_s: float) -> Handed:
        waits.append(timeout_s)
        if len(waits) == 2:
            stop.set()
        return None

    ops = _run_idle(db, clock, redis_server, prefix, wake, stop, batch_window_s=0.0)
    assert ops == ["claim", "finish", "mark_sent"]
    assert {r.state for r in OutboxStore(db, clock).list()} == {"sent"}
