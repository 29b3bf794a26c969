"""The inbox and the task state machine (TaskStore), plus the Database underneath it."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import stat
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.errors import (
    ConfigError,
    EnvelopeError,
    FencedError,
    StaleError,
    StoreError,
    TaskCancelled,
)
from broker_adapter.protocol.bounds import PAYLOAD_MAX_BYTES
from broker_adapter.protocol.canonical import canonical_json, sha256_hex
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.reply import reply_id_for
from broker_adapter.store import (
    AcceptItem,
    Database,
    FailOutcome,
    Outcome,
    TaskState,
    TaskStore,
    open_database,
)
from broker_adapter.store.inbox import conflict_reply_id
from broker_adapter.store.migrations import CONFLICT_ID_KEY, MIGRATIONS, SCHEMA_VERSION
from broker_adapter.store.task_types import TaskPolicy, UnknownTask
from tests.support.store_script import (
    LEASE_S,
    MAX_HOPS,
    RETENTION_S,
    T0,
    TASK_BACKOFF,
    Stores,
    dump,
    envelope,
    item,
    open_any,
    reopen,
    reply_body,
    stores,
    task_state,
)


@pytest.fixture
def s(store_target: str, clock: FakeClock) -> Iterator[Stores]:
    with open_any(store_target) as db:
        yield stores(db, clock)


def accept_one(s: Stores, mid: str = "m1", **overrides: Any) -> str:
    (res,) = s.tasks.accept([item(mid, **overrides)])
    assert res.outcome is Outcome.STORED, res
    assert res.task_id is not None
    return res.task_id


def claim_one(s: Stores, owner: str = "w1") -> tuple[str, int]:
    (task,) = s.tasks.claim(owner)
    return task.task_id, task.fence


def replies(s: Stores, task_id: str) -> list[dict[str, Any]]:
    return [r for r in dump(s.db)["outbox"] if r["task_id"] == task_id]


# -- accept ---------------------------------------------------------------------------------


def test_accept_stores_pending_task_with_inbox_record(s: Stores) -> None:
    (res,) = s.tasks.accept([AcceptItem("alice", envelope("m1"), entry_id="17-0")])
    assert (res.outcome, res.reply_id) == (Outcome.STORED, None)
    d = dump(s.db)
    (task,) = d["tasks"]
    assert task["task_id"] == res.task_id
    assert (task["state"], task["attempts"], task["fence"], task["owner"]) == (
        "pending",
        0,
        0,
        None,
    )
    assert (task["deadline"], task["not_before"], task["created_at"]) == (T0 + 600, T0, T0)
    assert json.loads(task["payload"]) == {"q": "m1"}
    (inbox,) = d["inbox"]
    assert (inbox["principal"], inbox["message_id"], inbox["task_id"]) == (
        "alice",
        "m1",
        res.task_id,
    )
    assert (inbox["entry_id"], inbox["received_at"]) == ("17-0", T0)
    assert d["outbox"] == []


def test_accept_returns_same_task_id_when_duplicate(s: Stores, clock: FakeClock) -> None:
    task_id = accept_one(s)
    clock.advance(5)
    before = dump(s.db)["tasks"]
    # A resend may count its hops again, and write its deadline as an integer: still
    # the same request.
    (res,) = s.tasks.accept([item("m1", deadline=int(T0 + 600), hops=2)])
    assert (res.outcome, res.task_id, res.reply_id) == (Outcome.DUPLICATE, task_id, None)
    d = dump(s.db)
    assert d["tasks"] == before
    assert d["inbox"][0]["duplicates"] == 1
    assert d["outbox"] == []


@pytest.mark.parametrize(
    "changed", [{"deadline": T0 + 601}, {"deadline": T0 + 599.5}, {"max_attempts": 5}]
)
def test_accept_resend_with_other_terms_is_a_conflict_with_its_reply(
    s: Stores, clock: FakeClock, changed: dict[str, Any]
) -> None:
    """The deadline and max_attempts are part of the request: a resend that changes them
    (no signed extension exists) is refused like other content, with a conflict reply."""
    task_id = accept_one(s)
    before = dump(s.db)
    clock.advance(1)
    (res,) = s.tasks.accept([item("m1", **changed)])
    assert (res.outcome, res.task_id) == (Outcome.CONFLICT, task_id)
    after = dump(s.db)
    assert after["tasks"] == before["tasks"]
    (reply,) = after["outbox"]
    assert (reply["reply_id"], reply["status"]) == (res.reply_id, "conflict")
    body = json.loads(reply["body"])
    assert body["fingerprint"] == envelope("m1", **changed).fingerprint()
    assert body["stored_fingerprint"] == before["inbox"][0]["fingerprint"]


def test_accept_returns_duplicate_when_repeated_in_one_batch(s: Stores) -> None:
    first, second = s.tasks.accept([item("m1"), item("m1")])
    assert (first.outcome, second.outcome) == (Outcome.STORED, Outcome.DUPLICATE)
    assert first.task_id == second.task_id
    assert len(dump(s.db)["tasks"]) == 1


def test_accept_treats_same_id_from_two_principals_as_two_requests(s: Stores) -> None:
    a, b = s.tasks.accept([item("m1", principal="alice"), item("m1", principal="bob")])
    assert (a.outcome, b.outcome) == (Outcome.STORED, Outcome.STORED)
    assert a.task_id != b.task_id


def test_accept_conflict_leaves_stored_row_untouched_and_enqueues_one_reply(
    s: Stores, clock: FakeClock
) -> None:
    task_id = accept_one(s)
    before = dump(s.db)
    clock.advance(1)
    (res,) = s.tasks.accept([item("m1", payload={"q": "something else"})])
    assert (res.outcome, res.task_id) == (Outcome.CONFLICT, task_id)
    assert res.reply_id is not None
    expected_id = s.tasks.conflict_reply_id(
        "alice", "m1", envelope("m1", payload={"q": "something else"}).fingerprint()
    )
    assert res.reply_id == expected_id
    after = dump(s.db)
    assert after["tasks"] == before["tasks"]
    assert after["inbox"][0]["fingerprint"] == before["inbox"][0]["fingerprint"]
    assert after["inbox"][0]["conflicts"] == 1
    (reply,) = after["outbox"]
    assert (reply["reply_id"], reply["task_id"], reply["status"]) == (
        res.reply_id,
        None,
        "conflict",
    )
    body = json.loads(reply["body"])
    assert (body["task_id"], body["status"]) == (task_id, "conflict")
    assert body["stored_fingerprint"] == before["inbox"][0]["fingerprint"]


def test_accept_conflict_reuses_reply_id_when_repeated(s: Stores, clock: FakeClock) -> None:
    accept_one(s)
    (first,) = s.tasks.accept([item("m1", payload={"q": "x"})])
    clock.advance(10)
    (again,) = s.tasks.accept([item("m1", payload={"q": "x"})])
    assert again.reply_id == first.reply_id
    d = dump(s.db)
    assert len(d["outbox"]) == 1
    assert d["inbox"][0]["conflicts"] == 2
    (other,) = s.tasks.accept([item("m1", payload={"q": "y"})])
    assert other.reply_id != first.reply_id
    assert len(dump(s.db)["outbox"]) == 2


def test_conflict_reply_id_needs_the_databases_key(s: Stores, tmp_path: Path) -> None:
    """The conflict answer's id is an HMAC with the database's random key: stable for one
    database (reopened too), different in another, and not the public hash of the fields."""
    accept_one(s)
    (res,) = s.tasks.accept([item("m1", payload={"q": "x"})])
    fingerprint = envelope("m1", payload={"q": "x"}).fingerprint()
    key = s.db.meta(CONFLICT_ID_KEY)
    assert len(key) == 32
    assert res.reply_id == conflict_reply_id(key, "alice", "m1", fingerprint)
    public = sha256_hex(f"alice\0m1\0{fingerprint}".encode())  # the former id
    assert res.reply_id != f"c-{public[:32]}"
    with reopen(s.db) as again:
        assert TaskStore(again).conflict_reply_id("alice", "m1", fingerprint) == res.reply_id
    with open_database(tmp_path / "other.db") as other:
        assert TaskStore(other).conflict_reply_id("alice", "m1", fingerprint) != res.reply_id


def test_accept_conflict_does_not_affect_other_items_in_batch(s: Stores) -> None:
    task_id = accept_one(s)
    res = s.tasks.accept([item("m2"), item("m1", payload={"q": "x"}), item("m3")])
    assert [r.outcome for r in res] == [Outcome.STORED, Outcome.CONFLICT, Outcome.STORED]
    assert res[1].task_id == task_id
    assert s.tasks.counts()["pending"] == 3


@pytest.mark.parametrize(
    ("deadline", "outcome"),
    [(T0, Outcome.EXPIRED), (T0 - 100, Outcome.EXPIRED), (T0 + 0.001, Outcome.STORED)],
)
def test_accept_expires_at_once_when_deadline_not_after_now(
    s: Stores, deadline: float, outcome: Outcome
) -> None:
    (res,) = s.tasks.accept([item("m1", deadline=deadline)])
    assert res.outcome is outcome
    assert res.task_id is not None
    if outcome is Outcome.EXPIRED:
        assert res.reply_id == reply_id_for(res.task_id)
        assert task_state(s, res.task_id) == "expired"
        assert reply_body(s, res.task_id)["status"] == "expired"
    else:
        assert replies(s, res.task_id) == []


@pytest.mark.parametrize(
    ("hops", "outcome"), [(MAX_HOPS, Outcome.STORED), (MAX_HOPS + 1, Outcome.HOP_LIMIT)]
)
def test_accept_ends_in_hop_limit_when_hops_exceed_limit(
    s: Stores, hops: int, outcome: Outcome
) -> None:
    (res,) = s.tasks.accept([item("m1", hops=hops)])
    assert res.outcome is outcome
    assert res.task_id is not None
    if outcome is Outcome.HOP_LIMIT:
        assert task_state(s, res.task_id) == "hop_limit"
        body = reply_body(s, res.task_id)
        assert body["status"] == "hop_limit"
        assert f"hops {hops}" in body["error"]
        assert s.tasks.claim("w1") == []


@pytest.mark.parametrize("kind", ["result", "event"])
def test_accept_writes_nothing_when_kind_is_not_task(s: Stores, kind: str) -> None:
    before = dump(s.db)
    (res,) = s.tasks.accept([item("m1", kind=kind)])
    assert (res.outcome, res.task_id) == (Outcome.NOT_TASK, None)
    assert dump(s.db) == before


def test_accept_returns_nothing_when_batch_empty(s: Stores) -> None:
    assert s.tasks.accept([]) == []
    assert dump(s.db)["tasks"] == []


# -- retention and purge --------------------------------------------------------------------


def finish_task(s: Stores, task_id: str) -> str:
    (task,) = [t for t in s.tasks.claim("w1", 10) if t.task_id == task_id]
    return s.tasks.finish(task_id, "w1", task.fence, {"ok": True})


def test_accept_is_new_task_when_reused_past_retention_after_terminal(
    s: Stores, clock: FakeClock
) -> None:
    old = accept_one(s)
    finish_task(s, old)
    clock.set(T0 + RETENTION_S - 0.001)
    (dup,) = s.tasks.accept([item("m1")])
    assert (dup.outcome, dup.task_id) == (Outcome.DUPLICATE, old)
    clock.set(T0 + RETENTION_S)
    fresh: dict[str, Any] = {
        "payload": {"q": "new content is fine too"},
        "deadline": clock.now() + 60,
    }
    (res,) = s.tasks.accept([item("m1", **fresh)])
    assert res.outcome is Outcome.STORED
    assert res.task_id not in (None, old)
    assert task_state(s, old) == "done"
    found = s.tasks.find("alice", "m1")
    assert found is not None
    assert found.task_id == res.task_id


def _accept_with_long_window(s: Stores, mid: str, deadline: float) -> str:
    """Accept ``mid`` through a store with a window 20 times longer on the same file: a
    record from before the window was shortened (or before it bounded deadlines), whose
    deadline lies beyond the current window."""
    longer = TaskStore(s.db, s.tasks.clock, TaskPolicy(retention_s=20 * RETENTION_S))
    (res,) = longer.accept([item(mid, deadline=deadline)])
    assert res.outcome is Outcome.STORED, res
    assert res.task_id is not None
    return res.task_id


def test_accept_is_duplicate_when_live_task_reused_past_retention(
    s: Stores, clock: FakeClock
) -> None:
    task_id = _accept_with_long_window(s, "m1", T0 + 10 * RETENTION_S)
    clock.set(T0 + 2 * RETENTION_S)
    (dup,) = s.tasks.accept([item("m1", deadline=T0 + 10 * RETENTION_S)])
    assert (dup.outcome, dup.task_id) == (Outcome.DUPLICATE, task_id)
    (conflict,) = s.tasks.accept([item("m1", payload={"q": "x"})])
    assert (conflict.outcome, conflict.task_id) == (Outcome.CONFLICT, task_id)
    assert s.tasks.counts()["pending"] == 1


def test_purge_forgets_terminal_sent_records_past_retention(s: Stores, clock: FakeClock) -> None:
    old = accept_one(s)
    reply_id = finish_task(s, old)
    clock.set(T0 + RETENTION_S + 1)
    assert s.tasks.purge() == 0  # the reply is not sent yet
    (row,) = s.outbox.claim("d1", 1)
    s.outbox.mark_sent(reply_id, "d1", row.fence, "1-0")
    # Sent only now: the outbox keeps the reply a whole window after its publication.
    clock.advance(RETENTION_S - 0.001)
    assert s.tasks.purge() == 0
    clock.advance(0.001)
    assert s.tasks.purge() == 1
    d = dump(s.db)
    # The whole request goes together: its record, its task and its reply.
    assert (d["inbox"], d["tasks"], d["outbox"]) == ([], [], [])
    assert s.tasks.find("alice", "m1") is None
    new = accept_one(s, deadline=clock.now() + 60)
    assert new != old


def test_purge_keeps_records_when_live_or_within_retention(s: Stores, clock: FakeClock) -> None:
    done = accept_one(s, "done")
    reply_id = finish_task(s, done)
    live = _accept_with_long_window(s, "live", T0 + 10 * RETENTION_S)
    (row,) = s.outbox.claim("d1", 1)
    s.outbox.mark_sent(reply_id, "d1", row.fence, "1-0")
    clock.set(T0 + RETENTION_S - 1)
    assert s.tasks.purge() == 0
    clock.set(T0 + RETENTION_S + 1)
    assert s.tasks.purge() == 1
    assert s.tasks.find("alice", "live") is not None
    assert task_state(s, live) == "pending"


@pytest.mark.parametrize(
    ("deadline", "outcome"),
    [
        (T0 + RETENTION_S, Outcome.STORED),  # the edge itself is inside the window
        (T0 + RETENTION_S + 0.001, Outcome.REFUSED),
        (T0 + 1000 * 365 * 24 * 3600.0, Outcome.REFUSED),
        (1e300, Outcome.REFUSED),
    ],
)
def test_accept_refuses_deadline_beyond_retention_window(
    s: Stores, deadline: float, outcome: Outcome
) -> None:
    before = dump(s.db)
    (res,) = s.tasks.accept([item("m1", deadline=deadline)])
    assert res.outcome is outcome
    if outcome is Outcome.STORED:
        assert res.refusal is None
        assert task_state(s, res.task_id) == "pending"  # type: ignore[arg-type]
        return
    assert res.task_id is None
    assert res.refusal is not None
    assert (res.refusal.field, res.refusal.reason) == ("deadline", "too_large")
    assert dump(s.db) == before  # nothing written: a corrected resend is a new request
    (fixed,) = s.tasks.accept([item("m1", deadline=T0 + 60)])
    assert fixed.outcome is Outcome.STORED


def test_accept_refusal_does_not_harm_the_rest_of_its_batch(s: Stores) -> None:
    res = s.tasks.accept([item("m1"), item("m2", deadline=1e300), item("m3")])
    assert [r.outcome for r in res] == [Outcome.STORED, Outcome.REFUSED, Outcome.STORED]
    assert s.tasks.counts()["pending"] == 2


def _send_reply(s: Stores, reply_id: str) -> None:
    (row,) = [r for r in s.outbox.claim("d1", 10) if r.reply_id == reply_id]
    s.outbox.mark_sent(reply_id, "d1", row.fence, "1-0")


@pytest.mark.parametrize("purged", [False, True])
def test_accept_replay_after_window_ends_expired_never_runs(
    s: Stores, clock: FakeClock, purged: bool
) -> None:
    """The same envelope, replayed by anyone who can read the stream once its record is
    forgotten (or purged), is expired at once: its deadline lies inside the first window."""
    env = envelope("m1", deadline=T0 + RETENTION_S)
    (first,) = s.tasks.accept([AcceptItem("alice", env)])
    assert first.task_id is not None
    _send_reply(s, finish_task(s, first.task_id))
    clock.set(T0 + RETENTION_S - 0.001)
    assert s.tasks.purge() == 0
    (dup,) = s.tasks.accept([AcceptItem("alice", env)])
    assert (dup.outcome, dup.task_id) == (Outcome.DUPLICATE, first.task_id)
    clock.set(T0 + RETENTION_S)
    if purged:
        assert s.tasks.purge() == 1
    (replay,) = s.tasks.accept([AcceptItem("alice", env)])
    assert replay.outcome is Outcome.EXPIRED
    assert s.tasks.claim("w2", 10) == []
    counts = s.tasks.counts()
    done = 0 if purged else 1  # the purge took the first task with its record
    assert (counts["done"], counts["pending"], counts["expired"]) == (done, 0, 1)


def test_inbox_record_outlives_window_until_its_deadline(s: Stores, clock: FakeClock) -> None:
    """A record whose deadline lies beyond the window (accepted under a longer one) still
    dedupes, terminal and past the window, until the deadline passes; purge keeps it too."""
    task_id = _accept_with_long_window(s, "m1", T0 + 5 * RETENTION_S)
    _send_reply(s, finish_task(s, task_id))
    clock.set(T0 + 5 * RETENTION_S - 1)
    assert s.tasks.purge() == 0
    (dup,) = s.tasks.accept([item("m1", deadline=T0 + 5 * RETENTION_S)])
    assert (dup.outcome, dup.task_id) == (Outcome.DUPLICATE, task_id)
    (changed,) = s.tasks.accept([item("m1", deadline=clock.now() + 60)])
    assert (changed.outcome, changed.task_id) == (Outcome.CONFLICT, task_id)
    clock.set(T0 + 5 * RETENTION_S)
    assert s.tasks.purge() == 1


def _documented_key(principal: str, message_id: str) -> str:
    """The idempotency key as docs and README define it, written out independently."""
    digest = hashlib.sha256(principal.encode() + b"\x00" + message_id.encode()).hexdigest()
    return "ba:" + digest[:32]


def test_idempotency_key_is_the_same_for_every_task_of_one_request(
    s: Stores, clock: FakeClock
) -> None:
    first_id = accept_one(s)
    (first,) = s.tasks.claim("w1")
    s.tasks.finish(first_id, "w1", first.fence, {"ok": True})
    clock.set(T0 + RETENTION_S + 1)  # forgotten: the same identity becomes a second task
    second_id = accept_one(s, deadline=clock.now() + 60)
    (second,) = s.tasks.claim("w1")
    assert (first.task_id, second.task_id) == (first_id, second_id)
    assert first_id != second_id
    assert first.idempotency_key == second.idempotency_key == _documented_key("alice", "m1")
    s.tasks.accept([item("m1", principal="bob", deadline=clock.now() + 60)])
    (bobs,) = s.tasks.claim("w1")
    assert bobs.idempotency_key == _documented_key("bob", "m1") != first.idempotency_key


# -- claim ----------------------------------------------------------------------------------


def test_claim_sets_owner_lease_attempts_and_fence(s: Stores, clock: FakeClock) -> None:
    task_id = accept_one(s, correlation_id="c1", parent_id="p1")
    clock.advance(2)
    (task,) = s.tasks.claim("w1", 5)
    assert (task.task_id, task.owner, task.attempt, task.fence) == (task_id, "w1", 1, 1)
    assert (task.lease_until, task.deadline, task.max_attempts) == (T0 + 2 + LEASE_S, T0 + 600, 3)
    assert (task.payload, task.kind, task.hops) == ({"q": "m1"}, "task", 0)
    assert (task.correlation_id, task.parent_id, task.principal) == ("c1", "p1", "alice")
    row = s.tasks.get(task_id)
    assert row is not None
    assert (row.state, row.owner, row.lease_until, row.attempts) == (
        "running",
        "w1",
        T0 + 2 + LEASE_S,
        1,
    )


def test_claim_takes_at_most_n_in_not_before_order(s: Stores, clock: FakeClock) -> None:
    ids = []
    for n in range(4):
        ids.append(accept_one(s, f"m{n}"))
        clock.advance(1)
    assert s.tasks.claim("w1", 0) == []
    first = s.tasks.claim("w1", 3)
    assert [t.task_id for t in first] == ids[:3]
    assert [t.task_id for t in s.tasks.claim("w2", 3)] == ids[3:]
    assert s.tasks.claim("w3", 3) == []


def test_claim_skips_tasks_waiting_out_backoff(s: Stores, clock: FakeClock) -> None:
    task_id = accept_one(s)
    _, fence = claim_one(s)
    assert s.tasks.fail(task_id, "w1", fence, "flaky", retryable=True) is FailOutcome.RETRY
    row = s.tasks.get(task_id)
    assert row is not None
    assert s.tasks.claim("w2") == []
    clock.set(row.not_before)
    (task,) = s.tasks.claim("w2")
    assert (task.attempt, task.fence, task.owner) == (2, 2, "w2")


def test_claim_keeps_idempotency_key_stable_across_attempts(s: Stores, clock: FakeClock) -> None:
    task_id = accept_one(s)
    (first,) = s.tasks.claim("w1")
    clock.advance(LEASE_S)
    (second,) = s.tasks.claim("w2")
    assert second.fence == first.fence + 1
    assert first.task_id == second.task_id == task_id
    assert first.idempotency_key == second.idempotency_key == _documented_key("alice", "m1")


def test_claim_never_hands_out_cancelled_or_terminal_tasks(s: Stores) -> None:
    cancelled = accept_one(s, "m1")
    s.tasks.cancel(cancelled)
    accept_one(s, "m2", deadline=T0 + 10)
    assert [t.message_id for t in s.tasks.claim("w1", 10)] == ["m2"]


# -- finish ---------------------------------------------------------------------------------


def test_finish_writes_done_and_exactly_one_reply(s: Stores, clock: FakeClock) -> None:
    task_id = accept_one(s, correlation_id="c9")
    _, fence = claim_one(s)
    clock.advance(3)
    reply_id = s.tasks.finish(task_id, "w1", fence, {"answer": [1, "é"]})
    assert reply_id == reply_id_for(task_id) == f"r-{task_id}"
    row = s.tasks.get(task_id)
    assert row is not None
    assert (row.state, row.owner, row.lease_until, row.finished_at) == ("done", None, None, T0 + 3)
    assert row.result == '{"answer":[1,"é"]}'
    (reply,) = replies(s, task_id)
    assert (reply["reply_id"], reply["state"], reply["status"]) == (reply_id, "pending", "done")
    assert json.loads(reply["body"]) == {
        "v": 1,
        "reply_id": reply_id,
        "task_id": task_id,
        "principal": "alice",
        "message_id": "m1",
        "correlation_id": "c9",
        "status": "done",
        "result": {"answer": [1, "é"]},
        "error": None,
        "attempts": 1,
        "fence": 1,
        "finished_at": T0 + 3,
    }


def test_finish_is_refused_when_already_done(s: Stores) -> None:
    task_id = accept_one(s)
    _, fence = claim_one(s)
    s.tasks.finish(task_id, "w1", fence, 1)
    before = dump(s.db)
    with pytest.raises(StaleError) as info:
        s.tasks.finish(task_id, "w1", fence, 2)
    assert info.value.reason == "not_running"
    assert dump(s.db) == before


@pytest.mark.parametrize("result", [{1, 2}, float("nan"), {"a": float("inf")}, b"raw"])
def test_finish_writes_nothing_when_result_is_not_json(s: Stores, result: Any) -> None:
    task_id = accept_one(s)
    _, fence = claim_one(s)
    before = dump(s.db)
    with pytest.raises(ValueError):  # noqa: PT011 - documented contract
        s.tasks.finish(task_id, "w1", fence, result)
    assert dump(s.db) == before
    assert task_state(s, task_id) == "running"


def test_finish_writes_nothing_when_result_is_over_the_bounds(s: Stores) -> None:
    task_id = accept_one(s)
    _, fence = claim_one(s)
    before = dump(s.db)
    with pytest.raises(EnvelopeError) as info:
        s.tasks.finish(task_id, "w1", fence, "x" * PAYLOAD_MAX_BYTES)  # 2 bytes over
    assert (info.value.field, info.value.reason) == ("result", "too_large")
    assert dump(s.db) == before
    s.tasks.finish(task_id, "w1", fence, "x" * (PAYLOAD_MAX_BYTES - 2))  # at the bound
    assert task_state(s, task_id) == "done"


def test_finish_raises_unknown_task_when_no_such_task(s: Stores) -> None:
    with pytest.raises(UnknownTask):
        s.tasks.finish("nope", "w1", 1, None)


# -- stale writes: refused, nothing written -------------------------------------------------

STALE_OPS = ["finish", "fail_retryable", "fail_final", "renew"]


def do(s: Stores, op: str, task_id: str, owner: str, fence: int) -> object:
    if op == "finish":
        return s.tasks.finish(task_id, owner, fence, {"late": True})
    if op == "fail_retryable":
        return s.tasks.fail(task_id, owner, fence, "late", retryable=True)
    if op == "fail_final":
        return s.tasks.fail(task_id, owner, fence, "late", retryable=False)
    return s.tasks.renew(task_id, owner, fence)


def stale_fence(s: Stores, clock: FakeClock) -> tuple[str, str, int]:
    task_id = accept_one(s)
    _, fence = claim_one(s, "w1")
    clock.advance(LEASE_S)
    (task,) = s.tasks.claim("w2")  # reclaimed: fence + 1
    assert task.fence == fence + 1
    return task_id, "w1", fence


def stale_lease(s: Stores, clock: FakeClock) -> tuple[str, str, int]:
    task_id = accept_one(s)
    _, fence = claim_one(s, "w1")
    clock.advance(LEASE_S)  # lease_until == now: expired, nobody reclaimed it yet
    assert task_state(s, task_id) == "running"
    return task_id, "w1", fence


def stale_cancelled(s: Stores, clock: FakeClock) -> tuple[str, str, int]:
    task_id = accept_one(s)
    _, fence = claim_one(s, "w1")
    assert s.tasks.cancel(task_id, "user asked") is TaskState.CANCELLED
    return task_id, "w1", fence


def stale_deadline(s: Stores, clock: FakeClock) -> tuple[str, str, int]:
    task_id = accept_one(s, deadline=T0 + LEASE_S / 2)
    _, fence = claim_one(s, "w1")
    clock.set(T0 + LEASE_S / 2)  # lease still good, deadline reached
    return task_id, "w1", fence


def stale_owner(s: Stores, clock: FakeClock) -> tuple[str, str, int]:
    task_id = accept_one(s)
    _, fence = claim_one(s, "w1")
    return task_id, "mallory", fence


def stale_requeued(s: Stores, clock: FakeClock) -> tuple[str, str, int]:
    task_id = accept_one(s)
    _, fence = claim_one(s, "w1")
    clock.advance(LEASE_S)
    assert s.tasks.reconcile()["requeued"] == 1  # back to pending, fence unchanged
    return task_id, "w1", fence


#: prepares a stale situation; returns (task_id, owner, fence) of the write to attempt
Prepare = Callable[[Stores, FakeClock], tuple[str, str, int]]
STALE_CASES: dict[str, tuple[Prepare, type[StaleError]]] = {
    "fence": (stale_fence, FencedError),
    "lease_expired": (stale_lease, StaleError),
    "cancelled": (stale_cancelled, TaskCancelled),
    "deadline": (stale_deadline, StaleError),
    "owner": (stale_owner, StaleError),
    "not_running": (stale_requeued, StaleError),
}


@pytest.mark.parametrize("op", STALE_OPS)
@pytest.mark.parametrize("reason", list(STALE_CASES))
def test_task_fenced_write_is_refused_and_writes_nothing_when_stale(
    s: Stores, clock: FakeClock, op: str, reason: str
) -> None:
    prepare, error = STALE_CASES[reason]
    task_id, owner, fence = prepare(s, clock)
    before = dump(s.db)
    with pytest.raises(error) as info:
        do(s, op, task_id, owner, fence)
    assert type(info.value) is error
    assert (info.value.reason, info.value.task_id) == (reason, task_id)
    assert dump(s.db) == before


def test_fenced_error_reports_both_tokens(s: Stores, clock: FakeClock) -> None:
    task_id, owner, fence = stale_fence(s, clock)
    with pytest.raises(FencedError) as info:
        s.tasks.finish(task_id, owner, fence, None)
    assert (info.value.token, info.value.current) == (1, 2)


@pytest.mark.parametrize("op", STALE_OPS)
def test_task_fenced_write_succeeds_just_before_lease_ends(
    s: Stores, clock: FakeClock, op: str
) -> None:
    task_id = accept_one(s)
    _, fence = claim_one(s)
    clock.advance(LEASE_S - 0.001)
    do(s, op, task_id, "w1", fence)
    assert dump(s.db)["tasks"][0]["updated_at"] == clock.now()


# -- fail -----------------------------------------------------------------------------------


def test_fail_requeues_with_backoff_when_retryable(s: Stores, clock: FakeClock) -> None:
    task_id = accept_one(s)
    _, fence = claim_one(s)
    clock.advance(1)
    assert s.tasks.fail(task_id, "w1", fence, "timeout", retryable=True) is FailOutcome.RETRY
    row = s.tasks.get(task_id)
    assert row is not None
    assert (row.state, row.owner, row.lease_until, row.attempts) == ("pending", None, None, 1)
    assert (row.error, row.deadline) == ("timeout", T0 + 600)
    ceiling = TASK_BACKOFF.ceiling(1)
    assert T0 + 1 + ceiling / 2 <= row.not_before <= T0 + 1 + ceiling
    assert replies(s, task_id) == []


def test_fail_backoff_grows_capped_with_jitter_and_never_moves_deadline(
    s: Stores, clock: FakeClock
) -> None:
    task_id = accept_one(s, max_attempts=10, deadline=T0 + RETENTION_S)
    delays = []
    for attempt in range(1, 10):
        (task,) = s.tasks.claim("w1")
        assert (task.attempt, task.fence, task.deadline) == (attempt, attempt, T0 + RETENTION_S)
        now = clock.now()
        assert s.tasks.fail(task_id, "w1", task.fence, "x", retryable=True) is FailOutcome.RETRY
        row = s.tasks.get(task_id)
        assert row is not None
        delay = row.not_before - now
        ceiling = TASK_BACKOFF.ceiling(attempt)
        assert ceiling == min(TASK_BACKOFF.cap_s, TASK_BACKOFF.base_s * 2 ** (attempt - 1))
        assert ceiling / 2 <= delay <= ceiling
        delays.append(delay)
        clock.set(row.not_before)
    assert max(delays) <= TASK_BACKOFF.cap_s
    assert delays[-1] > TASK_BACKOFF.cap_s / 2 - 1e-9  # capped, not collapsed to zero
    assert len({round(d, 9) for d in delays[3:]}) > 1  # jitter: not all the same
    (task,) = s.tasks.claim("w1")
    assert task.attempt == 10
    assert s.tasks.fail(task_id, "w1", task.fence, "x", retryable=True) is FailOutcome.FAILED
    row = s.tasks.get(task_id)
    assert row is not None
    assert (row.state, row.attempts, row.deadline) == ("failed", 10, T0 + RETENTION_S)
    assert row.error == "x (attempts exhausted: 10/10)"
    assert reply_body(s, task_id)["error"] == "x (attempts exhausted: 10/10)"


def test_fail_ends_failed_at_once_when_not_retryable(s: Stores) -> None:
    task_id = accept_one(s)
    _, fence = claim_one(s)
    assert s.tasks.fail(task_id, "w1", fence, "bad input", retryable=False) is FailOutcome.FAILED
    assert task_state(s, task_id) == "failed"
    body = reply_body(s, task_id)
    assert (body["status"], body["error"], body["attempts"]) == ("failed", "bad input", 1)


def test_fail_ends_failed_when_backoff_would_pass_deadline(s: Stores, clock: FakeClock) -> None:
    task_id = accept_one(s, deadline=T0 + 0.4)  # first backoff is at least 0.5 s
    _, fence = claim_one(s)
    assert s.tasks.fail(task_id, "w1", fence, "flaky", retryable=True) is FailOutcome.FAILED
    row = s.tasks.get(task_id)
    assert row is not None
    assert (row.state, row.deadline, row.attempts) == ("failed", T0 + 0.4, 1)
    assert row.error == "flaky (no retry: the deadline comes first)"


def test_retries_never_extend_deadline_so_task_expires(s: Stores, clock: FakeClock) -> None:
    task_id = accept_one(s, max_attempts=10, deadline=T0 + 20)
    for _ in range(3):
        (task,) = s.tasks.claim("w1")
        s.tasks.fail(task_id, "w1", task.fence, "x", retryable=True)
        row = s.tasks.get(task_id)
        assert row is not None
        assert row.deadline == T0 + 20
        clock.set(row.not_before)
    clock.set(T0 + 20)
    assert s.tasks.claim("w1") == []
    assert task_state(s, task_id) == "expired"
    assert reply_body(s, task_id)["error"] == "deadline reached"


# -- renew ----------------------------------------------------------------------------------


def test_renew_extends_lease_from_now(s: Stores, clock: FakeClock) -> None:
    task_id = accept_one(s)
    _, fence = claim_one(s)
    clock.advance(20)
    assert s.tasks.renew(task_id, "w1", fence) == T0 + 20 + LEASE_S
    clock.advance(LEASE_S - 1)  # past the first lease, inside the renewed one
    assert s.tasks.reconcile() == {"expired": 0, "requeued": 0, "exhausted": 0}
    s.tasks.finish(task_id, "w1", fence, None)
    assert task_state(s, task_id) == "done"


# -- cancel ---------------------------------------------------------------------------------


def test_cancel_makes_pending_task_cancelled_with_one_reply(s: Stores) -> None:
    task_id = accept_one(s)
    assert task_state(s, task_id) != TaskState.CANCELLED
    assert s.tasks.cancel(task_id, "changed my mind") is TaskState.CANCELLED
    assert task_state(s, task_id) == TaskState.CANCELLED
    body = reply_body(s, task_id)
    assert (body["status"], body["error"]) == ("cancelled", "changed my mind")


def test_cancel_returns_terminal_state_and_writes_nothing_when_already_terminal(
    s: Stores,
) -> None:
    task_id = accept_one(s)
    _, fence = claim_one(s)
    s.tasks.finish(task_id, "w1", fence, None)
    before = dump(s.db)
    assert s.tasks.cancel(task_id) is TaskState.DONE
    assert dump(s.db) == before
    assert task_state(s, task_id) != TaskState.CANCELLED


def test_cancel_raises_unknown_task_when_no_such_task(s: Stores) -> None:
    with pytest.raises(UnknownTask):
        s.tasks.cancel("nope")
    assert s.tasks.get("nope") is None


# -- reconcile ------------------------------------------------------------------------------


def test_reconcile_requeues_expired_lease_keeping_attempts(s: Stores, clock: FakeClock) -> None:
    task_id = accept_one(s)
    claim_one(s, "w1")
    clock.advance(LEASE_S - 0.001)
    assert s.tasks.reconcile()["requeued"] == 0
    clock.advance(0.001)
    assert s.tasks.reconcile() == {"expired": 0, "requeued": 1, "exhausted": 0}
    row = s.tasks.get(task_id)
    assert row is not None
    assert (row.state, row.owner, row.attempts, row.fence) == ("pending", None, 1, 1)
    assert (row.not_before, row.error) == (clock.now(), "lease of w1 expired")
    assert replies(s, task_id) == []


def test_reconcile_fails_task_when_lease_expires_on_last_attempt(
    s: Stores, clock: FakeClock
) -> None:
    task_id = accept_one(s, max_attempts=2)
    claim_one(s, "w1")
    clock.advance(LEASE_S)
    claim_one(s, "w2")  # reconciles w1's lease, then takes attempt 2
    clock.advance(LEASE_S)
    assert s.tasks.reconcile() == {"expired": 0, "requeued": 0, "exhausted": 1}
    row = s.tasks.get(task_id)
    assert row is not None
    assert (row.state, row.attempts) == ("failed", 2)
    assert reply_body(s, task_id)["error"] == "lease of w2 expired on the last attempt (2/2)"


def test_reconcile_expires_live_tasks_at_deadline_with_reply(s: Stores, clock: FakeClock) -> None:
    pending = accept_one(s, "p", deadline=T0 + 10)
    running = accept_one(s, "r", deadline=T0 + 10)
    later = accept_one(s, "l", deadline=T0 + 11)
    (task,) = [t for t in s.tasks.claim("w1", 3) if t.task_id == running]
    clock.set(T0 + 10)
    counts = s.tasks.reconcile()
    assert counts["expired"] == 2
    assert {task_state(s, pending), task_state(s, running)} == {"expired"}
    for task_id in (pending, running):
        body = reply_body(s, task_id)
        assert (body["status"], body["error"]) == ("expired", "deadline reached")
    assert task_state(s, later) != "expired"
    assert len(dump(s.db)["outbox"]) == 2
    with pytest.raises(StaleError):
        s.tasks.finish(running, "w1", task.fence, None)


def test_reconcile_writes_nothing_when_nothing_is_due(s: Stores, clock: FakeClock) -> None:
    accept_one(s)
    claim_one(s)
    before = dump(s.db)
    assert s.tasks.reconcile() == {"expired": 0, "requeued": 0, "exhausted": 0}
    assert dump(s.db) == before


def test_task_store_counts_every_state(s: Stores) -> None:
    accept_one(s, "a")
    accept_one(s, "b")
    claim_one(s)
    counts = s.tasks.counts()
    assert set(counts) == {st.value for st in TaskState}
    assert (counts["pending"], counts["running"], counts["done"]) == (1, 1, 0)


# -- the Database ---------------------------------------------------------------------------


def test_database_migrates_new_file_to_current_version(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    with open_database(path) as db:
        assert db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.conn.execute("PRAGMA synchronous").fetchone()[0] == 2
        assert db.conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        tables = {r[0] for r in db.conn.execute("SELECT name FROM sqlite_master")}
        assert {"tasks", "inbox", "outbox", "receipts"} <= tables
        assert db.integrity_check() == "ok"
    with open_database(path) as db:  # reopening is a no-op migration
        assert db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_database_migrates_version_1_file_and_keeps_its_rows(tmp_path: Path) -> None:
    """A file of schema version 1 (with ``tasks_state``) is brought up to date in place:
    its rows stay, the index is gone, and the store goes on working on it."""
    path = tmp_path / "v1.db"
    with open_database(path) as db:
        store = TaskStore(db, clock=FakeClock(T0))
        [old] = store.accept([AcceptItem("alice", envelope("m-old"))])
    raw = sqlite3.connect(str(path), isolation_level=None)
    raw.execute("CREATE INDEX tasks_state ON tasks (state)")  # as version 1 made it
    raw.execute("PRAGMA user_version = 1")
    raw.close()
    with open_database(path) as db:
        assert db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        indexes = {
            r[0] for r in db.conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")
        }
        assert "tasks_state" not in indexes
        assert {"tasks_ready", "tasks_leases", "tasks_live_deadline"} <= indexes
        store = TaskStore(db, clock=FakeClock(T0))
        found = store.find("alice", "m-old")
        assert found is not None
        assert found.task_id == old.task_id
        [new] = store.accept([AcceptItem("alice", envelope("m-new"))])
        assert new.outcome is Outcome.STORED
        assert store.counts()["pending"] == 2
        assert [c.task_id for c in store.claim("w1", 5)] == [old.task_id, new.task_id]
        assert db.integrity_check() == "ok"


def test_database_migration_recomputes_fingerprints_of_floats(tmp_path: Path) -> None:
    """A version-3 file holds fingerprints of the payload bytes as Python wrote them
    (``13.0``) and without the request's terms; versions 4 and 10 recompute them from the
    task rows, so a resend that writes ``13`` (a JavaScript publisher) is a duplicate, not
    a conflict, and one with another deadline is a conflict."""
    path = tmp_path / "v3.db"
    first = Envelope.from_json(
        '{"deadline":%r,"message_id":"m-float","payload":{"price":13.0,"t":1e-07},'
        '"sender":"alice"}' % (T0 + 600)
    )
    plain = envelope("m-plain")
    with open_database(path) as db:
        store = TaskStore(db, clock=FakeClock(T0))
        stored = store.accept([AcceptItem("alice", first), AcceptItem("alice", plain)])
        assert [r.outcome for r in stored] == [Outcome.STORED, Outcome.STORED]
    # as version 3 wrote them: SHA-256 of canonical_json(content), floats as Python's
    # repr, the deadline and max_attempts left out
    old = {
        env.message_id: sha256_hex(
            canonical_json(
                {k: v for k, v in env.content().items() if k not in ("deadline", "max_attempts")}
            )
        )
        for env in (first, plain)
    }
    assert old["m-float"] != first.fingerprint()
    assert old["m-plain"] != plain.fingerprint()
    raw = sqlite3.connect(str(path), isolation_level=None)
    for mid, fingerprint in old.items():
        raw.execute("UPDATE tasks SET fingerprint = ? WHERE message_id = ?", (fingerprint, mid))
        raw.execute("UPDATE inbox SET fingerprint = ? WHERE message_id = ?", (fingerprint, mid))
    raw.execute("PRAGMA user_version = 3")
    raw.close()
    with open_database(path) as db:
        assert db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        rows = {
            r["message_id"]: (r["t"], r["i"])
            for r in db.conn.execute(
                "SELECT t.message_id, t.fingerprint AS t, i.fingerprint AS i"
                " FROM tasks t JOIN inbox i ON i.task_id = t.task_id"
            )
        }
        assert rows == {
            "m-float": (first.fingerprint(), first.fingerprint()),
            "m-plain": (plain.fingerprint(), plain.fingerprint()),
        }
        resend = Envelope.from_json(
            f'{{"deadline":{int(T0 + 600)},"message_id":"m-float",'
            '"payload":{"price":13,"t":1e-7},"sender":"alice"}'
        )
        later = TaskStore(db, clock=FakeClock(T0 + 5))
        (again,) = later.accept([AcceptItem("alice", resend)])
        assert (again.outcome, again.task_id) == (Outcome.DUPLICATE, stored[0].task_id)
        (changed,) = later.accept([AcceptItem("alice", resend.replace(deadline=T0 + 900))])
        assert (changed.outcome, changed.task_id) == (Outcome.CONFLICT, stored[0].task_id)


def test_database_file_is_created_private(tmp_path: Path) -> None:
    """0600 for the file, and so for its -wal and -shm (SQLite gives them its mode),
    whatever the umask would have allowed."""
    path = tmp_path / "new.db"
    old_umask = os.umask(0o022)
    try:
        with open_database(path) as db:
            TaskStore(db, clock=FakeClock(T0)).accept([AcceptItem("alice", envelope("m1"))])
            for name in ("new.db", "new.db-wal", "new.db-shm"):
                assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    finally:
        os.umask(old_umask)


def test_database_tightens_an_existing_file_others_may_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "shared.db"
    with open_database(path):
        pass
    path.chmod(0o664)
    with caplog.at_level("WARNING", logger="broker_adapter.store"), open_database(path):
        pass
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "had mode 0664; tightened to 0600" in caplog.text


def _state_checks(conn: sqlite3.Connection) -> dict[str, str]:
    return {
        name: sql
        for name, sql in conn.execute(
            "SELECT name, sql FROM sqlite_master WHERE name IN ('tasks', 'outbox')"
        )
    }


def test_database_migrates_version_2_state_checks_to_equality_chains(tmp_path: Path) -> None:
    """Version 3 rewrites the ``state IN (...)`` CHECKs of a version-2 file as ``=`` chains:
    rows stay, a connection opened before the migration sees the new text, and a state
    outside the list is still refused on both tables."""
    path = tmp_path / "v2.db"
    raw = sqlite3.connect(str(path), isolation_level=None)
    raw.execute("PRAGMA journal_mode = WAL")
    for script in MIGRATIONS[:2]:
        assert isinstance(script, str)
        raw.executescript(script)
    raw.execute("PRAGMA user_version = 2")
    before = _state_checks(raw)
    assert "state IN ('pending', 'running', 'done'" in before["tasks"]
    assert "state IN ('pending', 'sending', 'sent', 'dead')" in before["outbox"]
    with open_database(path) as db:
        assert db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        store = TaskStore(db, clock=FakeClock(T0))
        [stored] = store.accept([AcceptItem("alice", envelope("m-1"))])
        assert stored.outcome is Outcome.STORED
        assert db.integrity_check() == "ok"
    after = _state_checks(raw)  # the old connection re-reads the schema
    assert "state = 'pending' OR state = 'running' OR state = 'done'" in after["tasks"]
    assert "state = 'waiting_approval')" in after["tasks"]
    outbox_check = "state = 'pending' OR state = 'sending' OR state = 'sent' OR state = 'dead')"
    assert outbox_check in after["outbox"]
    assert "CHECK (max_attempts BETWEEN 1 AND 10)" in after["tasks"]  # other CHECKs as they were
    with pytest.raises(sqlite3.IntegrityError, match="CHECK constraint failed"):
        raw.execute("UPDATE tasks SET state = 'lost'")
    with pytest.raises(sqlite3.IntegrityError, match="CHECK constraint failed"):
        raw.execute(
            "INSERT INTO outbox (reply_id, principal, message_id, status, body, content_hash,"
            " state, not_before, created_at) VALUES ('r', 'alice', 'm', 'done', x'', 'h',"
            " 'gone', 0, 0)"
        )
    assert raw.execute("SELECT count(*) FROM tasks").fetchone()[0] == 1
    raw.close()


def test_new_database_has_no_in_list_checks(tmp_path: Path) -> None:
    with open_database(tmp_path / "new.db") as db:
        checks = _state_checks(db.conn)
        assert all(" IN (" not in sql for sql in checks.values()), checks
        with pytest.raises(sqlite3.IntegrityError, match="CHECK constraint failed"):
            db.conn.execute(
                "INSERT INTO tasks (task_id, principal, message_id, kind, payload, fingerprint,"
                " state, max_attempts, not_before, deadline, hops, created_at, updated_at)"
                " VALUES ('t', 'alice', 'm', 'task', '{}', 'f', 'Pending', 3, 0, 0, 0, 0, 0)"
            )


def test_database_refuses_file_with_newer_schema(tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    open_database(path).close()
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.close()
    with pytest.raises(StoreError, match="schema version"):
        open_database(path)
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1  # untouched
    raw.close()


def test_database_refuses_file_that_is_not_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "garbage.db"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError):
        open_database(path)


def test_database_refuses_unknown_synchronous_mode(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        Database(tmp_path / "x.db", synchronous="OFF")  # type: ignore[arg-type]


def test_database_rolls_back_write_when_body_raises(tmp_path: Path) -> None:
    def write_then_raise(db: Database) -> None:
        with db.write("accept") as c:
            c.execute(
                "INSERT INTO receipts (reply_id, content_hash, principal, body,"
                " received_at) VALUES ('r', 'h', 'p', x'00', 1)"
            )
            raise RuntimeError("boom")

    with open_database(tmp_path / "x.db") as db:
        with pytest.raises(RuntimeError, match="boom"):
            write_then_raise(db)
        assert dump(db)["receipts"] == []
        assert not db.conn.in_transaction


def test_database_refuses_use_after_fork(tmp_path: Path) -> None:
    with open_database(tmp_path / "x.db") as db, warnings.catch_warnings():
        # Python >= 3.12 warns when forking a process that runs threads; that is the point.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
        if pid == 0:  # the child: every use must be refused; close must not touch the parent
            code = 0
            try:
                uses: list[Callable[[], AbstractContextManager[sqlite3.Connection]]] = [
                    lambda: db.write("claim"),
                    db.read,
                ]
                for use in uses:
                    try:
                        with use():
                            code |= 1
                    except StoreError as exc:
                        code |= 0 if "fork" in str(exc) else 2
                db.close()
            except BaseException:  # noqa: BLE001 - report anything as a failure code
                code |= 4
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with db.write("claim") as c:  # the parent's connection still works
            c.execute("SELECT 1")
        assert db.integrity_check() == "ok"


def test_tasks_accept_counts_hops_from_the_parent_task_not_the_body(
    store_target: str, clock: FakeClock
) -> None:
    db = open_any(store_target)
    tasks = TaskStore(db, clock, TaskPolicy(max_hops=2))
    deadline = clock.now() + 60
    parent = Envelope.build(message_id="p", sender="a", payload={}, deadline=deadline)
    (root,) = tasks.accept([AcceptItem("a", parent)])
    assert root.task_id is not None
    chain = [root.task_id]
    outcomes = []
    for i in range(3):  # every child claims hops=0 in its body
        child = Envelope.build(
            message_id=f"c{i}", sender="a", payload={}, deadline=deadline, parent_id=chain[-1]
        )
        (res,) = tasks.accept([AcceptItem("a", child)])
        assert res.task_id is not None
        chain.append(res.task_id)
        outcomes.append(res.outcome)
    assert outcomes == [Outcome.STORED, Outcome.STORED, Outcome.HOP_LIMIT]
    by_id = {row["task_id"]: row["hops"] for row in dump(db)["tasks"]}
    assert [by_id[t] for t in chain] == [0, 1, 2, 3]
    db.close()


def test_an_error_text_with_a_nul_character_is_stored_and_replied(s: Stores) -> None:
    """A handler's exception text may hold any character: the failure commits on both
    backends (PostgreSQL's text keeps no NUL: the row has U+FFFD there), and the reply
    carries the text as it was."""
    task_id = accept_one(s)
    _, fence = claim_one(s)
    assert s.tasks.fail(task_id, "w1", fence, "bad\x00byte", retryable=False) is FailOutcome.FAILED
    row = s.tasks.get(task_id)
    assert row is not None
    assert row.error in ("bad\x00byte", "bad\ufffdbyte")
    assert reply_body(s, task_id)["error"] == "bad\x00byte"
    (reply,) = replies(s, task_id)
    (claimed,) = s.outbox.claim("d1", 1)
    s.outbox.mark_dead(claimed.reply_id, "d1", claimed.fence, "redis said \x00")
    dead = s.outbox.get(reply["reply_id"])
    assert dead is not None
    assert dead.state == "dead"
