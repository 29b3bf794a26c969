"""``store.effects.EffectsStore``: unknown outcomes, reconcile records, compensations and
cancel requests (schema migration 7), on a real SQLite file and a FakeClock."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.errors import FencedError, StaleError, TaskCancelled
from broker_adapter.store import TaskState, open_database
from broker_adapter.store.effects import EffectsStore
from broker_adapter.store.migrations import MIGRATIONS, SCHEMA_VERSION, _split
from broker_adapter.store.task_types import UnknownTask
from tests.support.store_script import (
    LEASE_S,
    T0,
    Stores,
    dump,
    item,
    open_any,
    reply_body,
    running,
    stores,
    task_row,
)

RECONCILE_LEASE_S = 20.0
DEADLINE_S = 600.0  # store_script's envelopes: T0 + 600


@pytest.fixture
def s(store_target: str, clock: FakeClock) -> Iterator[Stores]:
    """The stores on SQLite and on PostgreSQL (``store_target``)."""
    with open_any(store_target) as db:
        yield stores(db, clock)


def unknown(s: Stores, fx: EffectsStore, mid: str = "m1", **over: Any) -> str:
    task_id, fence = running(s, mid, **over)
    fx.mark_effect_started(task_id, "w1", fence)
    fx.to_unknown(task_id, "w1", fence, "call timed out after its effect started")
    return task_id


# -- migration ------------------------------------------------------------------------------


def test_migration_7_adds_columns_and_tables_to_a_version_6_database(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    raw = sqlite3.connect(path, isolation_level=None)
    for migration in MIGRATIONS[:6]:
        if callable(migration):
            migration(raw)
        else:
            for statement in _split(migration):
                raw.execute(statement)
    raw.execute("PRAGMA user_version = 6")
    raw.execute(
        "INSERT INTO tasks (task_id, principal, message_id, kind, payload, fingerprint, state,"
        " max_attempts, not_before, deadline, hops, created_at, updated_at)"
        " VALUES ('t1', 'alice', 'm1', 'task', '{}', 'f', 'pending', 3, 0, 1, 0, 0, 0)"
    )
    raw.close()
    with open_database(path) as db:
        assert db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 7
        (task,) = dump(db)["tasks"]
        assert (task["reconcile_tries"], task["effect_fence"], task["cancel_requested_at"]) == (
            0,
            None,
            None,
        )
        tables = {r[0] for r in db.conn.execute("SELECT name FROM sqlite_master")}
        assert {
            "approvals",
            "approval_waits",
            "reconcile_log",
            "compensations",
            "tasks_unknown",
        } <= tables
        db.conn.execute("PRAGMA user_version = 6")
    with open_database(path) as db:  # run again on its own result: nothing added twice
        assert db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


# -- cancel requests ------------------------------------------------------------------------


def test_cancel_of_a_running_task_is_a_request_the_others_cancel_at_once(
    s: Stores, fx: EffectsStore, clock: FakeClock
) -> None:
    task_id, fence = running(s)
    assert fx.request_cancel(task_id) is TaskState.RUNNING
    assert fx.cancel_requested(task_id) == T0
    clock.advance(1)
    assert fx.request_cancel(task_id) is TaskState.RUNNING  # the first request's time stays
    assert fx.cancel_requested(task_id) == T0
    assert task_row(s, task_id)["state"] == "running"
    s.tasks.finish(task_id, "w1", fence, {"partial": True})  # the holder still commits
    (pending,) = s.tasks.accept([item("m2")])
    assert pending.task_id is not None
    assert fx.request_cancel(pending.task_id) is TaskState.CANCELLED
    assert fx.cancel_requested(pending.task_id) is None
    with pytest.raises(UnknownTask):
        fx.request_cancel("nope")


def test_a_requested_cancel_is_seen_by_its_holder_and_renewed_only_during_the_grace(
    s: Stores, fx: EffectsStore, clock: FakeClock
) -> None:
    task_id, fence = running(s)
    assert s.tasks.refusal(task_id, "w1", fence) is None
    assert fx.request_cancel(task_id) is TaskState.RUNNING
    assert isinstance(s.tasks.refusal(task_id, "w1", fence), TaskCancelled)  # its next check
    grace = s.tasks.policy.cancel_grace_s
    clock.advance(grace - 1)
    s.tasks.renew(task_id, "w1", fence)  # the handler may still be stopping
    clock.advance(1)
    with pytest.raises(TaskCancelled):
        s.tasks.renew(task_id, "w1", fence)
    assert not fx.end_requested_cancel(task_id, "w2", fence, "not its holder")
    assert fx.end_requested_cancel(task_id, "w1", fence, "it stopped before its effect")
    body = reply_body(s, task_id)
    assert (body["status"], task_row(s, task_id)["state"]) == ("cancelled", "cancelled")
    assert body["error"].startswith(f"cancel requested {grace:.3f} s before the handler")
    assert not fx.end_requested_cancel(task_id, "w1", fence, "again")


# -- entering unknown -----------------------------------------------------------------------


def test_effect_mark_is_fenced(s: Stores, fx: EffectsStore) -> None:
    task_id, fence = running(s)
    with pytest.raises(FencedError):
        fx.mark_effect_started(task_id, "w1", fence + 1)
    with pytest.raises(StaleError, match="owner"):
        fx.mark_effect_started(task_id, "w2", fence)
    assert task_row(s, task_id)["effect_fence"] is None


def test_a_requested_cancel_stops_the_effect_from_starting(s: Stores, fx: EffectsStore) -> None:
    task_id, fence = running(s)
    fx.request_cancel(task_id)
    with pytest.raises(TaskCancelled):
        fx.mark_effect_started(task_id, "w1", fence)
    assert task_row(s, task_id)["effect_fence"] is None


def test_a_lapsed_lease_after_the_effect_started_goes_to_unknown_not_pending(
    s: Stores, fx: EffectsStore, clock: FakeClock
) -> None:
    marked, fence = running(s, "m1")
    fx.mark_effect_started(marked, "w1", fence)
    plain, _ = running(s, "m2")
    clock.advance(LEASE_S + 1)
    counts = s.tasks.reconcile()
    assert counts.get("unknown") == 1  # the effect-started one
    assert counts["requeued"] == 1  # the other one
    assert (task_row(s, marked)["state"], task_row(s, plain)["state"]) == ("unknown", "pending")
    assert "lapsed after its effect started" in task_row(s, marked)["error"]


def test_a_passed_deadline_after_the_effect_started_is_unknown_not_expired(
    s: Stores, fx: EffectsStore, clock: FakeClock
) -> None:
    task_id, fence = running(s)
    fx.mark_effect_started(task_id, "w1", fence)
    clock.set(T0 + DEADLINE_S)
    counts = s.tasks.reconcile()
    assert counts.get("unknown") == 1
    assert counts["expired"] == 0
    assert task_row(s, task_id)["state"] == "unknown"


def test_the_mark_of_an_earlier_attempt_does_not_count(
    s: Stores, fx: EffectsStore, clock: FakeClock
) -> None:
    task_id, fence = running(s)
    fx.mark_effect_started(task_id, "w1", fence)
    s.tasks.fail(task_id, "w1", fence, "failed before the effect", retryable=True)
    clock.advance(60)
    (again,) = s.tasks.claim("w2")
    clock.advance(LEASE_S + 1)
    counts = s.tasks.reconcile()
    assert counts.get("unknown", 0) == 0
    assert counts["requeued"] == 1
    assert task_row(s, again.task_id)["state"] == "pending"


def test_to_unknown_is_fenced(s: Stores, fx: EffectsStore) -> None:
    task_id, fence = running(s)
    with pytest.raises(FencedError):
        fx.to_unknown(task_id, "w1", fence - 1, "timeout")
    fx.to_unknown(task_id, "w1", fence, "timeout")
    r = task_row(s, task_id)
    assert (r["state"], r["owner"], r["error"]) == ("unknown", None, "timeout")
    with pytest.raises(StaleError, match="not_running"):
        fx.to_unknown(task_id, "w1", fence, "timeout")


# -- reconcile ------------------------------------------------------------------------------


def test_reconcile_claim_holds_under_a_lease_and_a_new_fence(
    s: Stores, fx: EffectsStore, clock: FakeClock
) -> None:
    task_id = unknown(s, fx)
    before = task_row(s, task_id)
    (claim,) = fx.claim_unknown("r1", 5, RECONCILE_LEASE_S)
    assert (claim.task.task_id, claim.task.fence, claim.tries) == (task_id, before["fence"] + 1, 0)
    assert claim.task.attempt == before["attempts"]  # a reconcile is no attempt
    assert claim.task.lease_until == T0 + RECONCILE_LEASE_S
    assert fx.claim_unknown("r2", 5, RECONCILE_LEASE_S) == []  # held
    clock.advance(RECONCILE_LEASE_S)
    (taken,) = fx.claim_unknown("r2", 5, RECONCILE_LEASE_S)  # the first reconciler died
    assert taken.task.fence == claim.task.fence + 1
    with pytest.raises(FencedError):
        fx.resolve_done(task_id, "r1", claim.task.fence, {"late": True})
    assert fx.reconcile_log(task_id) == []


def test_happened_is_done_with_the_observed_result_and_its_reply(
    s: Stores, fx: EffectsStore
) -> None:
    task_id = unknown(s, fx)
    (claim,) = fx.claim_unknown("r1", 1, RECONCILE_LEASE_S)
    fx.resolve_done(task_id, "r1", claim.task.fence, {"restarted": "web1"}, note="found it")
    assert task_row(s, task_id)["state"] == "done"
    body = reply_body(s, task_id)
    assert (body["status"], body["result"]) == ("done", {"restarted": "web1"})
    (record,) = fx.reconcile_log(task_id)
    assert (record.outcome, record.by_whom, record.fence, record.observed, record.note) == (
        "done",
        "r1",
        claim.task.fence,
        {"restarted": "web1"},
        "found it",
    )


def test_not_happened_is_pending_again_or_ends_when_nothing_is_left(
    s: Stores, fx: EffectsStore, clock: FakeClock
) -> None:
    retried = unknown(s, fx, "m1", max_attempts=2)
    last = unknown(s, fx, "m2", max_attempts=1)
    late = unknown(s, fx, "m3", max_attempts=3, deadline=T0 + 10)
    claims = {c.task.task_id: c.task.fence for c in fx.claim_unknown("r1", 5, RECONCILE_LEASE_S)}
    assert fx.resolve_not_done(retried, "r1", claims[retried]) is TaskState.PENDING
    assert fx.resolve_not_done(last, "r1", claims[last]) is TaskState.FAILED
    assert "attempts exhausted" in reply_body(s, last)["error"]
    clock.set(T0 + 10)  # the deadline does not end an unknown task, nor its reconcile
    assert fx.resolve_not_done(late, "r1", claims[late]) is TaskState.EXPIRED
    assert reply_body(s, late)["status"] == "expired"
    assert task_row(s, retried)["not_before"] == T0
    assert [r.outcome for r in fx.reconcile_log(retried)] == ["not-done"]


def test_still_unknown_backs_off_then_waits_for_an_operator(
    s: Stores, fx: EffectsStore, clock: FakeClock
) -> None:
    task_id = unknown(s, fx)
    (claim,) = fx.claim_unknown("r1", 1, RECONCILE_LEASE_S)
    fx.resolve_unknown(task_id, "r1", claim.task.fence, T0 + 100, note="target unreachable")
    assert fx.claim_unknown("r1", 1, RECONCILE_LEASE_S) == []
    clock.set(T0 + 100)
    (claim,) = fx.claim_unknown("r1", 1, RECONCILE_LEASE_S)
    assert claim.tries == 1
    fx.resolve_unknown(task_id, "r1", claim.task.fence, None)
    clock.advance(10_000)
    assert fx.claim_unknown("r1", 1, RECONCILE_LEASE_S) == []  # only an operator now
    assert fx.counts()["awaiting_operator"] == 1
    assert fx.operator_resolve(task_id, "done", "alice", observed={"seen": 1}) is TaskState.DONE
    assert reply_body(s, task_id)["result"] == {"seen": 1}
    assert [(r.outcome, r.by_whom) for r in fx.reconcile_log(task_id)] == [
        ("unknown", "r1"),
        ("unknown", "r1"),
        ("done", "alice"),
    ]


def test_an_operator_answer_fences_a_reconcile_in_flight(s: Stores, fx: EffectsStore) -> None:
    task_id = unknown(s, fx)
    (claim,) = fx.claim_unknown("r1", 1, RECONCILE_LEASE_S)
    assert fx.operator_resolve(task_id, "not-done", "alice") is TaskState.PENDING
    with pytest.raises(FencedError):
        fx.resolve_done(task_id, "r1", claim.task.fence, None)
    with pytest.raises(StaleError, match="not_unknown"):
        fx.operator_resolve(task_id, "done", "alice")
    with pytest.raises(UnknownTask):
        fx.operator_resolve("nope", "done", "alice")


# -- compensation ---------------------------------------------------------------------------


def test_a_compensation_is_begun_once_and_ended_once(s: Stores, fx: EffectsStore) -> None:
    task_id = unknown(s, fx)
    (claim,) = fx.claim_unknown("r1", 1, RECONCILE_LEASE_S)
    fence = claim.task.fence
    assert fx.begin_compensation(task_id, "duplicate", "r1", fence, "applied twice")
    assert not fx.begin_compensation(task_id, "duplicate", "r1", fence, "applied twice")
    with pytest.raises(FencedError):
        fx.begin_compensation(task_id, "other", "r1", fence - 1, "x")
    assert fx.end_compensation(task_id, "duplicate", "done", "refunded 1")
    assert not fx.end_compensation(task_id, "duplicate", "failed", "again")
    (record,) = fx.compensations(task_id)
    assert (record.kind, record.by_whom, record.outcome, record.detail) == (
        "duplicate",
        "r1",
        "done",
        "refunded 1",
    )
    assert fx.counts()["compensations_done"] == 1
