"""``store.approvals.ApprovalStore``: approval records, and the tasks waiting for one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.errors import StaleError
from broker_adapter.store import TaskState
from broker_adapter.store.approvals import ApprovalStore
from broker_adapter.store.effects import EffectsStore
from tests.support.store_script import T0, Stores, open_any, reply_body, running, stores, task_row

DEADLINE_S = 600.0  # store_script's envelopes: T0 + 600


@pytest.fixture
def s(store_target: str, clock: FakeClock) -> Iterator[Stores]:
    """The stores on SQLite and on PostgreSQL (``store_target``)."""
    with open_any(store_target) as db:
        yield stores(db, clock)


@pytest.fixture
def ap(s: Stores) -> ApprovalStore:
    return ApprovalStore(s.tasks)


def test_valid_approval_matches_exactly_and_not_when_expired_or_revoked(
    ap: ApprovalStore, clock: FakeClock
) -> None:
    approval_id = ap.grant_approval("restart", "web1", "prod", "alice", T0 + 60)
    found = ap.valid_approval("restart", "web1", "prod", T0)
    assert found is not None
    assert (found.approval_id, found.approver) == (approval_id, "alice")
    for other in (
        ("restart", "web2", "prod"),
        ("restart", "web1", "dev"),
        ("stop", "web1", "prod"),
    ):
        assert ap.valid_approval(*other, T0) is None
    assert ap.valid_approval("restart", "web1", "prod", T0 - 1) is None  # before the grant
    assert ap.valid_approval("restart", "web1", "prod", T0 + 60) is None  # expired
    assert ap.revoke_approval(approval_id, "bob")
    assert not ap.revoke_approval(approval_id, "bob")
    assert ap.valid_approval("restart", "web1", "prod", T0) is None
    later = ap.grant_approval("restart", "web1", "prod", "alice", T0 + 30)
    clock.set(T0 + 30)
    assert (ap.counts()["approvals_valid"], ap.counts()["approvals_expired"]) == (0, 1)
    assert ap.counts()["approvals_revoked"] == 1
    assert ap.valid_approval("restart", "web1", "prod") is None  # the store's clock: expired
    assert later.startswith("a-")
    with pytest.raises(ValueError, match="not after now"):
        ap.grant_approval("restart", "web1", "prod", "alice", T0)
    with pytest.raises(ValueError, match="approver"):
        ap.grant_approval("restart", "web1", "prod", "", T0 + 60)


def test_a_waiting_task_runs_after_its_approval_and_gets_its_attempt_back(
    s: Stores, ap: ApprovalStore, clock: FakeClock
) -> None:
    task_id, fence = running(s, max_attempts=1)
    until = ap.wait_for_approval(task_id, "w1", fence, "restart", "web1", "prod", 120)
    assert until == T0 + 120
    r = task_row(s, task_id)
    assert (r["state"], r["attempts"], r["owner"]) == ("waiting_approval", 0, None)
    assert ap.release_waits() == {"released": 0, "timed_out": 0, "dropped": 0}
    assert s.tasks.claim("w1") == []
    ap.grant_approval("restart", "web1", "prod", "alice", T0 + 3600)
    clock.advance(1)
    assert ap.release_waits()["released"] == 1
    (again,) = s.tasks.claim("w1")
    assert (again.task_id, again.attempt) == (task_id, 1)
    assert ap.counts()["waiting_approval"] == 0


def test_a_wait_past_its_approval_timeout_ends_failed_with_its_reply(
    s: Stores, ap: ApprovalStore, clock: FakeClock
) -> None:
    task_id, fence = running(s)
    approval_id = ap.grant_approval("restart", "web1", "prod", "alice", T0 + 3600)
    ap.revoke_approval(approval_id, "bob")  # revoked: does not release the wait
    ap.wait_for_approval(task_id, "w1", fence, "restart", "web1", "prod", 120)
    clock.advance(119)
    assert ap.release_waits()["timed_out"] == 0
    clock.advance(1)
    assert ap.release_waits()["timed_out"] == 1
    body = reply_body(s, task_id)
    assert body["status"] == "failed"
    assert body["error"].startswith("approval_timeout")


def test_an_approval_wait_never_outlasts_the_deadline(s: Stores, ap: ApprovalStore) -> None:
    task_id, fence = running(s)
    until = ap.wait_for_approval(task_id, "w1", fence, "a", "t", "s", 10 * DEADLINE_S)
    assert until == T0 + DEADLINE_S
    with pytest.raises(StaleError, match="not_running"):
        ap.wait_for_approval(task_id, "w1", fence, "a", "t", "s", 10)


def test_the_wait_of_a_cancelled_task_is_dropped(s: Stores, ap: ApprovalStore) -> None:
    task_id, fence = running(s)
    ap.wait_for_approval(task_id, "w1", fence, "a", "t", "s", 60)
    assert EffectsStore(s.tasks).request_cancel(task_id) is TaskState.CANCELLED
    assert ap.release_waits()["dropped"] == 1
    assert ap.counts()["waiting_approval"] == 0


def test_a_release_keeps_which_approval_released_the_task(
    s: Stores, ap: ApprovalStore, clock: FakeClock
) -> None:
    task_id, fence = running(s)
    ap.wait_for_approval(task_id, "w1", fence, "restart", "web1", "prod", 120)
    short = ap.grant_approval("restart", "web1", "prod", "alice", T0 + 60)
    longest = ap.grant_approval("restart", "web1", "prod", "bob", T0 + 600)
    clock.advance(1)
    assert ap.release_waits()["released"] == 1
    with s.db.read() as c:
        rows = c.execute("SELECT task_id, approval_id, released_at FROM approval_releases")
        found = [(r["task_id"], r["approval_id"], r["released_at"]) for r in rows.fetchall()]
    assert found == [(task_id, longest, T0 + 1)]  # the one that lasts longest, as checked
    assert short != longest
