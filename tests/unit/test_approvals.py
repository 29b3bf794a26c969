"""``store.approvals.ApprovalStore``: approval records, and the tasks waiting for one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypedDict

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.errors import StaleError
from broker_adapter.store import TaskState
from broker_adapter.store.approvals import ApprovalStore
from broker_adapter.store.effects import EffectsStore
from tests.support.store_script import T0, Stores, open_any, reply_body, running, stores, task_row

DEADLINE_S = 600.0  # store_script's envelopes: T0 + 600


#: What an approval is bound to besides action, target and scope (the requests of
#: store_script are alice's).
class Bound(TypedDict):
    principal: str
    arguments_digest: str


BOUND: Bound = {"principal": "alice", "arguments_digest": "d" * 64}


@pytest.fixture
def s(store_target: str, clock: FakeClock) -> Iterator[Stores]:
    """The stores on SQLite and on PostgreSQL (``store_target``)."""
    with open_any(store_target) as db:
        yield stores(db, clock)


@pytest.fixture
def ap(s: Stores) -> ApprovalStore:
    return ApprovalStore(s.tasks.tx)


def test_valid_approval_matches_exactly_and_not_when_expired_or_revoked(
    ap: ApprovalStore, clock: FakeClock
) -> None:
    approval_id = ap.grant_approval("restart", "web1", "prod", "alice", T0 + 60, **BOUND)
    found = ap.valid_approval("restart", "web1", "prod", T0, **BOUND)
    assert found is not None
    assert (found.approval_id, found.approver) == (approval_id, "alice")
    for other in (
        ("restart", "web2", "prod"),
        ("restart", "web1", "dev"),
        ("stop", "web1", "prod"),
    ):
        assert ap.valid_approval(*other, T0, **BOUND) is None
    for unbound in (
        Bound(principal="bob", arguments_digest=BOUND["arguments_digest"]),
        Bound(principal="alice", arguments_digest="e" * 64),
    ):
        assert ap.valid_approval("restart", "web1", "prod", T0, **unbound) is None
    assert ap.valid_approval("restart", "web1", "prod", T0 - 1, **BOUND) is None  # not yet
    assert ap.valid_approval("restart", "web1", "prod", T0 + 60, **BOUND) is None  # expired
    assert ap.revoke_approval(approval_id, "bob")
    assert not ap.revoke_approval(approval_id, "bob")
    assert ap.valid_approval("restart", "web1", "prod", T0, **BOUND) is None
    later = ap.grant_approval("restart", "web1", "prod", "alice", T0 + 30, **BOUND)
    clock.set(T0 + 30)
    assert (ap.counts()["approvals_valid"], ap.counts()["approvals_expired"]) == (0, 1)
    assert ap.counts()["approvals_revoked"] == 1
    assert ap.valid_approval("restart", "web1", "prod", **BOUND) is None  # the store's clock
    assert later.startswith("a-")
    with pytest.raises(ValueError, match="not after now"):
        ap.grant_approval("restart", "web1", "prod", "alice", T0, **BOUND)
    with pytest.raises(ValueError, match="approver"):
        ap.grant_approval("restart", "web1", "prod", "", T0 + 60, **BOUND)


def test_a_waiting_task_runs_after_its_approval_and_gets_its_attempt_back(
    s: Stores, ap: ApprovalStore, clock: FakeClock
) -> None:
    task_id, fence = running(s, max_attempts=1)
    until = ap.wait_for_approval(task_id, "w1", fence, "restart", "web1", "prod", 120, **BOUND)
    assert until == T0 + 120
    r = task_row(s, task_id)
    assert (r["state"], r["attempts"], r["owner"]) == ("waiting_approval", 0, None)
    assert ap.release_waits() == {"released": 0, "timed_out": 0, "dropped": 0}
    assert s.tasks.claim("w1") == []
    ap.grant_approval("restart", "web1", "prod", "alice", T0 + 3600, **BOUND)
    clock.advance(1)
    assert ap.release_waits()["released"] == 1
    (again,) = s.tasks.claim("w1")
    assert (again.task_id, again.attempt) == (task_id, 1)
    assert ap.counts()["waiting_approval"] == 0


def test_a_wait_past_its_approval_timeout_ends_failed_with_its_reply(
    s: Stores, ap: ApprovalStore, clock: FakeClock
) -> None:
    task_id, fence = running(s)
    approval_id = ap.grant_approval("restart", "web1", "prod", "alice", T0 + 3600, **BOUND)
    ap.revoke_approval(approval_id, "bob")  # revoked: does not release the wait
    ap.wait_for_approval(task_id, "w1", fence, "restart", "web1", "prod", 120, **BOUND)
    clock.advance(119)
    assert ap.release_waits()["timed_out"] == 0
    clock.advance(1)
    assert ap.release_waits()["timed_out"] == 1
    body = reply_body(s, task_id)
    assert body["status"] == "failed"
    assert body["error"].startswith("approval_timeout")


def test_an_approval_wait_never_outlasts_the_deadline(s: Stores, ap: ApprovalStore) -> None:
    task_id, fence = running(s)
    until = ap.wait_for_approval(task_id, "w1", fence, "a", "t", "s", 10 * DEADLINE_S, **BOUND)
    assert until == T0 + DEADLINE_S
    with pytest.raises(StaleError, match="not_running"):
        ap.wait_for_approval(task_id, "w1", fence, "a", "t", "s", 10, **BOUND)


def test_the_wait_of_a_cancelled_task_is_dropped(s: Stores, ap: ApprovalStore) -> None:
    task_id, fence = running(s)
    ap.wait_for_approval(task_id, "w1", fence, "a", "t", "s", 60, **BOUND)
    assert EffectsStore(s.tasks.tx).request_cancel(task_id) is TaskState.CANCELLED
    assert ap.release_waits()["dropped"] == 1
    assert ap.counts()["waiting_approval"] == 0


def test_a_release_keeps_which_approval_released_the_task(
    s: Stores, ap: ApprovalStore, clock: FakeClock
) -> None:
    task_id, fence = running(s)
    ap.wait_for_approval(task_id, "w1", fence, "restart", "web1", "prod", 120, **BOUND)
    short = ap.grant_approval("restart", "web1", "prod", "alice", T0 + 60, **BOUND)
    longest = ap.grant_approval("restart", "web1", "prod", "bob", T0 + 600, **BOUND)
    clock.advance(1)
    assert ap.release_waits()["released"] == 1
    with s.db.read() as c:
        rows = c.execute("SELECT task_id, approval_id, released_at FROM approval_releases")
        found = [(r["task_id"], r["approval_id"], r["released_at"]) for r in rows.fetchall()]
    assert found == [(task_id, longest, T0 + 1)]  # the one that lasts longest, as checked
    assert short != longest


# -- bound to what runs ---------------------------------------------------------------------


def _use(ap: ApprovalStore, task_id: str, fence: int, owner: str = "w1", **over: str) -> bool:
    digest = over.get("arguments_digest", BOUND["arguments_digest"])
    bound = Bound(principal=over.get("principal", BOUND["principal"]), arguments_digest=digest)
    return ap.use_approval(task_id, owner, fence, "restart", "web1", "prod", **bound) is not None


def test_an_approval_lets_only_its_principal_and_arguments_run(
    s: Stores, ap: ApprovalStore
) -> None:
    ap.grant_approval("restart", "web1", "prod", "carol", T0 + 600, **BOUND)
    task_id, fence = running(s)
    assert not _use(ap, task_id, fence, principal="bob")
    assert not _use(ap, task_id, fence, arguments_digest="e" * 64)
    assert _use(ap, task_id, fence)
    assert task_row(s, task_id)["approval_id"] is not None


@pytest.mark.parametrize("uses", [1, 2, 3])
def test_uses_lets_exactly_that_many_tasks_run_and_retries_use_no_more(
    s: Stores, ap: ApprovalStore, uses: int
) -> None:
    approval_id = ap.grant_approval(
        "restart", "web1", "prod", "carol", T0 + 600, uses=uses, **BOUND
    )
    tasks = [running(s, f"m{i}") for i in range(uses + 1)]
    assert [_use(ap, task_id, fence) for task_id, fence in tasks] == [True] * uses + [False]
    # a retry of a task that used it (same task, next claim) runs under it again
    first_id, first_fence = tasks[0]
    assert _use(ap, first_id, first_fence)
    found = ap.valid_approval("restart", "web1", "prod", T0, **BOUND)
    assert found is None  # used up
    assert ap.counts()["approvals_valid"] == 0
    row = s.db.fetch_one("SELECT used, uses FROM approvals WHERE approval_id = ?", (approval_id,))
    assert row is not None
    assert (row["used"], row["uses"]) == (uses, uses)


def test_a_used_approval_revoked_or_expired_stops_the_retry(
    s: Stores, ap: ApprovalStore, clock: FakeClock
) -> None:
    approval_id = ap.grant_approval("restart", "web1", "prod", "carol", T0 + 600, **BOUND)
    task_id, fence = running(s)
    assert _use(ap, task_id, fence)
    ap.revoke_approval(approval_id, "dave")
    assert not _use(ap, task_id, fence)


def test_only_the_holder_takes_a_use(s: Stores, ap: ApprovalStore) -> None:
    ap.grant_approval("restart", "web1", "prod", "carol", T0 + 600, **BOUND)
    task_id, fence = running(s)
    with pytest.raises(StaleError):
        _use(ap, task_id, fence, owner="w2")
    with pytest.raises(StaleError):
        _use(ap, task_id, fence + 1)
    assert ap.counts()["approvals_valid"] == 1  # nothing used


def test_a_release_needs_an_approval_with_a_use_left(
    s: Stores, ap: ApprovalStore, clock: FakeClock
) -> None:
    used_id, used_fence = running(s, "m1")
    ap.grant_approval("restart", "web1", "prod", "carol", T0 + 600, **BOUND)
    assert _use(ap, used_id, used_fence)
    task_id, fence = running(s, "m2")
    ap.wait_for_approval(
        task_id, "w1", fence, "restart", "web1", "prod", 120, **BOUND, arguments='{"server":"web1"}'
    )
    (wait,) = ap.waits()
    assert (wait.task_id, wait.principal, wait.arguments) == (task_id, "alice", '{"server":"web1"}')
    assert ap.release_waits()["released"] == 0  # the one approval is used up
    ap.grant_approval(
        "restart",
        "web1",
        "prod",
        "carol",
        T0 + 600,
        principal="bob",
        arguments_digest=BOUND["arguments_digest"],
    )
    assert ap.release_waits()["released"] == 0  # another principal's
    ap.grant_approval("restart", "web1", "prod", "carol", T0 + 600, **BOUND)
    assert ap.release_waits()["released"] == 1
