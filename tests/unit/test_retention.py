"""Retention: what the purge forgets and what it never touches, batch by batch; the
receipts' purge; the schedule; the file size of a database that keeps turning over."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.errors import StoreBusy
from broker_adapter.store import Outcome, TaskStore, open_database
from broker_adapter.store.retention import (
    PURGE_EVERY_S,
    PURGE_PAUSE_FACTOR,
    PURGE_PAUSE_S,
    PurgeBatch,
    PurgeSchedule,
)
from broker_adapter.store.settle import Settlement
from broker_adapter.store.task_types import TaskPolicy
from tests.support.store_script import (
    RETENTION_S,
    T0,
    SqliteStores,
    Stores,
    apply_receipt,
    dump,
    item,
    open_any,
    reopen,
    stores,
)


@pytest.fixture
def s(store_target: str, clock: FakeClock) -> Iterator[Stores]:
    with open_any(store_target) as db:
        yield stores(db, clock)


@pytest.fixture
def sq(tmp_path: Path, clock: FakeClock) -> Iterator[SqliteStores]:
    """The stores on SQLite only, for what only a SQLite file has (its size, pragmas)."""
    with open_database(tmp_path / "retention.db") as db:
        yield stores(db, clock)


def accepted(s: Stores, *mids: str, **overrides: Any) -> list[str]:
    results = s.tasks.accept([item(mid, **overrides) for mid in mids])
    assert all(r.outcome is Outcome.STORED for r in results), results
    return [r.task_id for r in results if r.task_id is not None]


def finished(s: Stores, task_ids: list[str]) -> list[str]:
    """Claim and finish ``task_ids``; their reply ids."""
    claimed = [t for t in s.tasks.claim("w1", 1000) if t.task_id in task_ids]
    assert len(claimed) == len(task_ids)
    items = [Settlement(t.task_id, "w1", t.fence, result="1") for t in claimed]
    out = s.tasks.settle_batch(items, "", 0).results
    return [str(r) for r in out]


def sent(s: Stores, reply_ids: list[str]) -> None:
    rows = [r for r in s.outbox.claim("d1", 1000) if r.reply_id in reply_ids]
    assert len(rows) == len(reply_ids)
    marks, _ = s.outbox.mark_sent_and_claim("d1", [(r.reply_id, r.fence, "1-0") for r in rows], 0)
    assert marks == [None] * len(rows)


def done_and_sent(s: Stores, *mids: str, **overrides: Any) -> list[str]:
    task_ids = accepted(s, *mids, **overrides)
    sent(s, finished(s, task_ids))
    return task_ids


def rows_of(s: Stores, task_id: str) -> dict[str, list[dict[str, Any]]]:
    d = dump(s.db)
    return {
        "tasks": [r for r in d["tasks"] if r["task_id"] == task_id],
        "inbox": [r for r in d["inbox"] if r["task_id"] == task_id],
        "outbox": [r for r in d["outbox"] if r["task_id"] == task_id],
    }


def no_dangling_references(s: Stores) -> None:
    if s.backend == "sqlite":
        assert s.sql("PRAGMA foreign_key_check") == []
    for child in ("inbox", "outbox"):  # PostgreSQL's foreign keys are never off: a check
        assert (
            s.sql(
                f"SELECT c.task_id FROM {child} c LEFT JOIN tasks t ON t.task_id = c.task_id"
                " WHERE c.task_id IS NOT NULL AND t.task_id IS NULL"
            )
            == []
        )


# -- what stays -------------------------------------------------------------------------------


def _pending(s: Stores) -> str:
    (task_id,) = accepted(s, "kept", deadline=T0 + RETENTION_S)
    return task_id


def _running(s: Stores) -> str:
    (task_id,) = accepted(s, "kept", deadline=T0 + RETENTION_S)
    (task,) = [t for t in s.tasks.claim("w9", 10) if t.task_id == task_id]
    # A lease that outlives the window (renewed all along): still running at the purge.
    s.sql("UPDATE tasks SET lease_until = ? WHERE task_id = ?", (T0 * 2, task.task_id))
    return task_id


def _waiting_approval(s: Stores) -> str:
    (task_id,) = accepted(s, "kept", deadline=T0 + RETENTION_S)
    s.sql("UPDATE tasks SET state = 'waiting_approval' WHERE task_id = ?", (task_id,))
    return task_id


def _reply_pending(s: Stores) -> str:
    (task_id,) = accepted(s, "kept")
    finished(s, [task_id])
    return task_id


def _reply_sending(s: Stores) -> str:
    task_id = _reply_pending(s)
    s.outbox.claim("d9", 10)  # claimed by a dispatcher that never came back
    return task_id


def _reply_dead(s: Stores) -> str:
    task_id = _reply_pending(s)
    (row,) = [r for r in s.outbox.claim("d9", 10) if r.task_id == task_id]
    s.outbox.mark_dead(row.reply_id, "d9", row.fence, "no trusted confirmation")
    return task_id


def _reply_sent_inside_window(s: Stores) -> str:
    task_id = _reply_pending(s)
    clock = s.tasks.clock
    assert isinstance(clock, FakeClock)
    clock.set(T0 + 1)  # sent a second later than the purgeable request's reply
    (reply_id,) = [r.reply_id for r in s.outbox.list("pending") if r.task_id == task_id]
    sent(s, [reply_id])
    clock.set(T0)
    return task_id


def _accepted_inside_window(s: Stores) -> str:
    clock = s.tasks.clock
    assert isinstance(clock, FakeClock)
    clock.set(T0 + 1)
    (task_id,) = done_and_sent(s, "kept")
    clock.set(T0)
    return task_id


def _deadline_ahead(s: Stores) -> str:
    # accepted under a longer window, before deadlines were bounded by this one
    longer = TaskStore(s.db, s.tasks.clock, TaskPolicy(retention_s=20 * RETENTION_S))
    (res,) = longer.accept([item("kept", deadline=T0 + RETENTION_S + 10)])
    assert res.task_id is not None
    sent(s, finished(s, [res.task_id]))
    return res.task_id


KEEPERS: dict[str, Callable[[Stores], str]] = {
    "pending": _pending,
    "running": _running,
    "waiting_approval": _waiting_approval,
    "reply_pending": _reply_pending,
    "reply_sending": _reply_sending,
    "reply_dead": _reply_dead,
    "reply_sent_inside_window": _reply_sent_inside_window,
    "accepted_inside_window": _accepted_inside_window,
    "deadline_ahead": _deadline_ahead,
}


@pytest.mark.parametrize("why", list(KEEPERS))
def test_purge_never_removes_a_request_that_is_live_unsent_or_inside_the_window(
    s: Stores, clock: FakeClock, why: str
) -> None:
    (gone,) = done_and_sent(s, "gone")
    kept = KEEPERS[why](s)
    before = rows_of(s, kept)
    assert before["tasks"]
    clock.set(T0 + RETENTION_S)  # the edge: the purgeable one is exactly one window old
    assert s.tasks.purge() == 1
    assert rows_of(s, gone) == {"tasks": [], "inbox": [], "outbox": []}
    assert rows_of(s, kept) == before
    no_dangling_references(s)


def test_purge_waits_for_the_window_to_the_edge(s: Stores, clock: FakeClock) -> None:
    (task_id,) = done_and_sent(s, "m1")
    clock.set(T0 + RETENTION_S - 0.001)
    assert s.tasks.purge() == 0
    assert rows_of(s, task_id)["inbox"]
    clock.set(T0 + RETENTION_S)
    assert s.tasks.purge() == 1


def test_purge_rechecks_each_request_inside_its_transaction(s: Stores, clock: FakeClock) -> None:
    """A data-loss resend puts a sent reply back in line between the purge's read and its
    transaction: the request stays."""
    (task_id,) = done_and_sent(s, "m1")
    clock.set(T0 + RETENTION_S + 1)
    write = s.db.write

    def resend_first(op: str, **options: Any) -> AbstractContextManager[Any]:
        with reopen(s.db) as other:
            assert stores(other, clock).outbox.requeue_sent() == 1
        return write(op, **options)

    s.db.write = resend_first  # type: ignore[method-assign,assignment]
    try:
        batch = s.tasks.purge_batch()
    finally:
        s.db.write = write  # type: ignore[method-assign]
    assert (batch.requests, batch.records, batch.replies) == (0, 0, 0)
    assert rows_of(s, task_id)["outbox"][0]["state"] == "pending"


# -- what goes, and how ---------------------------------------------------------------------


def test_purge_goes_in_batches_of_at_most_its_limit_and_past_rows_that_stay(
    s: Stores, clock: FakeClock
) -> None:
    early = done_and_sent(s, "a", "b", "c")
    stuck = _reply_dead(s)  # in the middle of the table: walked past, not deleted
    late = done_and_sent(s, "d", "e", "f", "g")
    clock.set(T0 + RETENTION_S)
    batches: list[PurgeBatch] = []
    after = 0
    while True:
        batch = s.tasks.purge_batch(after, limit=2)
        batches.append(batch)
        assert batch.requests <= 2
        assert batch.requests == batch.records == batch.replies
        if not batch.more:
            break
        after = batch.after
    assert sum(b.requests for b in batches) == 7
    assert len([b for b in batches if b.requests]) == 4  # 2 + 2 + 2 + 1
    assert all(b.lock_s >= b.work_s > 0 for b in batches if b.requests)
    d = dump(s.db)
    assert [t["task_id"] for t in d["tasks"]] == [stuck]
    assert all(rows_of(s, t) == {"tasks": [], "inbox": [], "outbox": []} for t in early + late)
    no_dangling_references(s)
    assert s.tasks.purge() == 0  # a new pass finds nothing more


def test_purge_stops_its_walk_at_the_first_request_inside_the_window(
    s: Stores, clock: FakeClock
) -> None:
    done_and_sent(s, "old")
    clock.set(T0 + 10)
    done_and_sent(s, "young")
    clock.set(T0 + RETENTION_S + 5)
    batch = s.tasks.purge_batch()
    assert (batch.requests, batch.more) == (1, False)
    assert s.tasks.find("alice", "young") is not None
    # The walk ended before the young request, not past it (SQLite's rowid, the seq here).
    cursor = "rowid" if s.backend == "sqlite" else "seq"
    ((young,),) = s.sql(f"SELECT {cursor} FROM tasks")
    assert batch.after == young - 1


def test_a_reused_ids_earlier_task_is_purged_and_the_new_request_kept(
    s: Stores, clock: FakeClock
) -> None:
    (old,) = done_and_sent(s, "m1")
    clock.set(T0 + RETENTION_S)
    (new,) = accepted(s, "m1", payload={"q": "again"}, deadline=clock.now() + 60)
    assert s.tasks.find("alice", "m1").task_id == new  # type: ignore[union-attr]
    sent(s, finished(s, [new]))
    assert s.tasks.purge() == 1  # the old task, left without a record, with its reply
    assert rows_of(s, old) == {"tasks": [], "inbox": [], "outbox": []}
    assert [len(v) for v in rows_of(s, new).values()] == [1, 1, 1]
    no_dangling_references(s)


def test_sent_conflict_answers_go_after_the_window_unsent_ones_stay(
    s: Stores, clock: FakeClock
) -> None:
    (task_id,) = accepted(s, "m1")
    (first,) = s.tasks.accept([item("m1", payload={"q": "other"})])
    (second,) = s.tasks.accept([item("m1", payload={"q": "third"})])
    assert first.outcome is second.outcome is Outcome.CONFLICT
    assert first.reply_id is not None
    assert second.reply_id is not None
    sent(s, [first.reply_id, *finished(s, [task_id])])
    clock.set(T0 + RETENTION_S)
    assert s.tasks.purge() == 1
    assert [r.reply_id for r in s.outbox.list()] == [second.reply_id]  # not sent: kept


def test_a_message_id_reused_after_the_purge_is_a_new_request_within_it_a_duplicate(
    s: Stores, clock: FakeClock
) -> None:
    env_item = item("m1", deadline=T0 + 600)
    (task_id,) = [r.task_id for r in s.tasks.accept([env_item])]
    assert task_id is not None
    sent(s, finished(s, [task_id]))
    clock.set(T0 + RETENTION_S - 1)
    assert s.tasks.purge() == 0
    (dup,) = s.tasks.accept([env_item])
    (conflict,) = s.tasks.accept([item("m1", payload={"q": "x"})])
    assert (dup.outcome, dup.task_id, conflict.outcome) == (
        Outcome.DUPLICATE,
        task_id,
        Outcome.CONFLICT,
    )
    clock.set(T0 + RETENTION_S + 1)
    sent(s, [str(conflict.reply_id)])
    clock.advance(RETENTION_S)
    assert s.tasks.purge() == 1
    assert dump(s.db)["outbox"] == []
    (replay,) = s.tasks.accept([env_item])  # the same bytes: a new request, expired at once
    assert replay.outcome is Outcome.EXPIRED
    (fresh,) = s.tasks.accept([item("m1", payload={"q": "y"}, deadline=clock.now() + 60)])
    # The replay holds the id now: within its window, other content is a conflict.
    assert (fresh.outcome, fresh.task_id) == (Outcome.CONFLICT, replay.task_id)


# -- receipts -------------------------------------------------------------------------------


def _receipt(s: Stores, reply_id: str) -> None:
    body = b'{"reply_id": "' + reply_id.encode() + b'"}'
    apply_receipt(
        s.receipts, reply_id=reply_id, content_hash="h", principal="alice", body=body, effect=None
    )


def test_receipts_go_after_the_window_to_the_edge_in_batches(s: Stores, clock: FakeClock) -> None:
    for i in range(5):
        _receipt(s, f"r-{i}")
    clock.set(T0 + 1)
    _receipt(s, "r-young")
    clock.set(T0 + RETENTION_S - 0.001)
    assert s.receipts.purge(RETENTION_S) == 0
    clock.set(T0 + RETENTION_S)
    batch = s.receipts.purge_batch(clock.now() - RETENTION_S, limit=2)
    assert (batch.receipts, batch.more) == (2, True)
    assert s.receipts.purge(RETENTION_S, limit=2) == 3
    assert [r.reply_id for r in s.receipts.list()] == ["r-young"]


# -- the file -------------------------------------------------------------------------------


def test_the_file_stops_growing_when_every_window_is_purged(
    sq: SqliteStores, clock: FakeClock
) -> None:
    """Freed pages are reused (SQLite's freelist): round after round of the same traffic,
    each purged once past the window, the file keeps the size of one round."""
    s = sq
    sizes = []
    for round_ in range(4):
        mids = [f"r{round_}-{i}" for i in range(600)]
        done_and_sent(s, *mids, deadline=clock.now() + 60)
        clock.advance(RETENTION_S)
        assert s.tasks.purge() == 600
        s.db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        sizes.append(os.path.getsize(s.db.path))
    assert sizes[-1] <= sizes[0] * 1.15, sizes
    with s.db.read() as c:
        assert c.execute("SELECT count(*) FROM tasks").fetchone()[0] == 0


# -- the schedule ---------------------------------------------------------------------------


def test_schedule_spaces_batches_and_passes(clock: FakeClock) -> None:
    log = logging.getLogger("test.purge")
    schedule = PurgeSchedule(clock, log)
    assert schedule.due()  # the first at once
    assert schedule.done(PurgeBatch(requests=3, after=7, more=True, lock_s=0.0001)) is None
    assert schedule.cursor == 7
    assert schedule.wait_s() == pytest.approx(PURGE_PAUSE_S, abs=1e-6)
    schedule.done(PurgeBatch(requests=3, after=9, more=True, lock_s=0.01))
    assert schedule.wait_s() == pytest.approx(PURGE_PAUSE_FACTOR * 0.01, abs=1e-6)
    finished = schedule.done(PurgeBatch(requests=1, after=12, more=False, lock_s=0.001))
    assert finished is not None
    assert (finished.requests, len(finished.lock_ms), schedule.cursor) == (7, 3, 0)
    assert schedule.wait_s() == pytest.approx(PURGE_EVERY_S, abs=1e-6)
    clock.advance(PURGE_EVERY_S - 0.001)
    assert not schedule.due()
    clock.advance(0.001)
    assert schedule.due()


def test_a_failing_batch_is_logged_and_tried_again_an_interval_later(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    schedule = PurgeSchedule(clock, logging.getLogger("test.purge"))

    def busy(after: int) -> PurgeBatch:
        raise StoreBusy("database is locked")

    with caplog.at_level(logging.WARNING):
        schedule.run_batch(busy)
    assert "purge failed" in caplog.text
    assert schedule.wait_s() == pytest.approx(PURGE_EVERY_S, abs=1e-6)
    clock.advance(PURGE_EVERY_S)
    with caplog.at_level(logging.INFO):
        schedule.run_batch(lambda after: PurgeBatch(requests=2, lock_s=0.002, work_s=0.001))
    assert "purged 2 requests" in caplog.text


def test_write_without_foreign_keys_turns_them_back_on(sq: SqliteStores) -> None:
    s = sq

    def fk() -> int:
        return int(s.db.conn.execute("PRAGMA foreign_keys").fetchone()[0])

    with s.db.write("purge", foreign_keys=False) as c:
        assert int(c.execute("PRAGMA foreign_keys").fetchone()[0]) == 0
    assert fk() == 1
    with pytest.raises(RuntimeError), s.db.write("purge", foreign_keys=False):
        raise RuntimeError("boom")
    assert fk() == 1


# -- the setting ----------------------------------------------------------------------------


def test_retention_flag_and_variable_reach_the_configs_and_stores(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from broker_adapter.app import adapter as runner
    from broker_adapter.app import cli
    from broker_adapter.app.adapter_config import AdapterConfig
    from broker_adapter.stages.receiver import receiver

    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    class FakeRunner:
        def __init__(self, config: AdapterConfig) -> None:
            seen["run"] = config
            raise Stop

    def fake_receiver(config: receiver.ReceiverConfig, *args: Any, **kwargs: Any) -> None:
        seen["receive"] = config
        raise Stop

    monkeypatch.setattr(runner, "Adapter", FakeRunner)
    monkeypatch.setattr(receiver, "Receiver", fake_receiver)
    keyring = tmp_path / "k.json"
    keyring.write_text('{"alice": {"k1": "a secret of thirty-two bytes or more"}}')
    keyring.chmod(0o600)
    run = [
        "run",
        "--redis",
        "redis://127.0.0.1:1/0",
        "--db",
        str(tmp_path / "a.db"),
        "--handler",
        "broker_adapter.examples:echo",
        "--keyring",
        str(keyring),
    ]
    receive = [
        "receive",
        "--redis",
        "redis://127.0.0.1:1/0",
        "--db",
        str(tmp_path / "r.db"),
        "--principal",
        "alice",
        "--keyring",
        str(keyring),
    ]

    def configs(*extra: str) -> tuple[float, float]:
        for argv, name in ((run, "run"), (receive, "receive")):
            with pytest.raises(Stop):
                cli.COMMANDS[name](cli.build_parser().parse_args([*argv, *extra]))
        return seen["run"].retention_s, seen["receive"].retention_s

    monkeypatch.delenv("BA_RETENTION_S", raising=False)
    assert configs() == (604_800.0, 604_800.0)  # the published default: 7 days
    monkeypatch.setenv("BA_RETENTION_S", "90")
    assert configs() == (90.0, 90.0)
    assert configs("--retention", "30") == (30.0, 30.0)  # the flag wins
    # The runner's policy (its ingest, workers and purge) carries it.
    config = AdapterConfig(
        redis_url="redis://x",
        db_path=tmp_path / "p.db",
        handler="broker_adapter.examples:echo",
        keyring_path=keyring,
        retention_s=30,
    )
    monkeypatch.undo()
    assert runner.Adapter(config).policy.retention_s == 30
    with pytest.raises(ValueError, match="greater than 0"):
        receiver.ReceiverConfig(principal="alice", retention_s=0)


# -- effect records ---------------------------------------------------------------------------


def test_a_purged_task_takes_its_effect_records_and_old_approvals_go(
    sq: SqliteStores, clock: FakeClock
) -> None:
    from broker_adapter.store.approvals import ApprovalStore

    (task_id,) = done_and_sent(sq, "m1")
    (kept,) = accepted(sq, "kept", deadline=T0 + RETENTION_S)
    approvals = ApprovalStore(sq.tasks.tx)
    old = approvals.grant_approval(
        "restart", "web1", "prod", "alice", T0 + 0.5, principal="alice", arguments_digest="d" * 64
    )
    with sq.db.write("test") as c:
        for tid in (task_id, kept):
            c.execute(
                "INSERT INTO reconcile_log (task_id, outcome, by_whom, at, fence)"
                " VALUES (?, 'done', 'r', ?, 1)",
                (tid, T0),
            )
            c.execute(
                "INSERT INTO compensations (task_id, kind, by_whom, fence, what,"
                " started_at, outcome) VALUES (?, 'duplicate', 'r', 1, 'x', ?, 'done')",
                (tid, T0),
            )
            c.execute(
                "INSERT INTO approval_waits (task_id, action, target, scope, since,"
                " until) VALUES (?, 'restart', 'web1', 'prod', ?, ?)",
                (tid, T0, T0 + 1),
            )
            c.execute(
                "INSERT INTO approval_releases (task_id, approval_id, released_at)"
                " VALUES (?, ?, ?)",
                (tid, old, T0),
            )
    clock.set(T0 + RETENTION_S + 1)
    fresh = approvals.grant_approval(
        "restart",
        "web2",
        "prod",
        "alice",
        clock.now() + 60,
        principal="alice",
        arguments_digest="d" * 64,
    )
    assert sq.tasks.purge() == 1
    d = dump(sq.db)
    with sq.db.read() as c:
        for table in ("reconcile_log", "compensations", "approval_waits", "approval_releases"):
            left = [r[0] for r in c.execute(f"SELECT task_id FROM {table}").fetchall()]
            assert left == [kept], table
        ids = [r[0] for r in c.execute("SELECT approval_id FROM approvals").fetchall()]
    assert ids == [fresh]
    assert old not in ids
    assert [r["task_id"] for r in d["tasks"]] == [kept]
