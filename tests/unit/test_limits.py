"""Ingress limits (``limits.IngressLimits``) on a fake clock, and the store's count of open
tasks that the quota reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.stages.ingest.limits import (
    QUOTA_EXCEEDED,
    RATE_LIMITED,
    IngressLimits,
    default_burst,
)
from broker_adapter.store import AcceptItem, TaskStore
from tests.support.ingest_script import envelope


def admitted(limits: IngressLimits, principal: str, n: int) -> int:
    """How many of ``n`` entries from ``principal`` are admitted, now."""
    return sum(limits.admit(principal) is None for _ in range(n))


def test_bucket_admits_its_burst_then_refuses_until_a_token_comes_back(clock: FakeClock) -> None:
    limits = IngressLimits(clock, rate_limit=4.0, rate_burst=10)
    assert admitted(limits, "mallory", 10) == 10  # the whole burst, on a frozen clock
    refusal = limits.admit("mallory")  # the 11th
    assert refusal is not None
    assert refusal.reason == RATE_LIMITED
    assert "mallory" in refusal.detail
    assert "burst 10" in refusal.detail
    clock.advance(0.24)  # 0.96 of a token: still refused
    assert limits.admit("mallory") is not None
    clock.advance(0.01)  # one token (1/4 s) since the last refill
    assert limits.admit("mallory") is None
    assert limits.admit("mallory") is not None
    clock.advance(3600)  # a long pause refills to the burst, never beyond
    assert admitted(limits, "mallory", 20) == 10


def test_one_principals_flood_leaves_anothers_bucket_alone(clock: FakeClock) -> None:
    limits = IngressLimits(clock, rate_limit=1.0, rate_burst=2)
    assert admitted(limits, "mallory", 5_000) == 2
    assert admitted(limits, "alice", 2) == 2
    assert limits.admit("alice") is not None


def test_default_burst_is_one_second_and_a_clock_stepping_back_refills_nothing(
    clock: FakeClock,
) -> None:
    assert (default_burst(0.2), default_burst(2.5), default_burst(100)) == (1, 3, 100)
    limits = IngressLimits(clock, rate_limit=2.5)
    assert limits.burst == 3
    assert admitted(limits, "alice", 5) == 3
    clock.set(clock.now() - 100)
    assert limits.admit("alice") is not None
    clock.set(clock.now() + 100.4)  # 0.4 s past the last refill: exactly one token
    assert limits.admit("alice") is None


def test_no_limits_admit_everything_and_never_count(clock: FakeClock) -> None:
    def counts() -> dict[str, int]:
        raise AssertionError("no quota: the store is never asked")

    limits = IngressLimits(clock, open_counts=counts)
    assert not limits.enabled
    assert admitted(limits, "alice", 1_000) == 1_000


def test_quota_refuses_at_the_limit_counts_admissions_and_rereads_per_batch(
    clock: FakeClock,
) -> None:
    store = {"alice": 2}
    reads: list[int] = []

    def counts() -> dict[str, int]:
        reads.append(1)
        return dict(store)

    limits = IngressLimits(clock, max_open_tasks=3, open_counts=counts)
    limits.new_batch()
    assert limits.admit("alice") is None  # 2 open < 3: admitted, now 3 in this batch
    refusal = limits.admit("alice")
    assert refusal is not None
    assert refusal.reason == QUOTA_EXCEEDED
    assert "3 open tasks, limit 3" in refusal.detail
    assert admitted(limits, "bob", 3) == 3  # nobody else's count moved
    assert limits.admit("bob") is not None
    assert len(reads) == 1  # one read per batch
    store["alice"] = 3  # the store saw the admitted task
    limits.new_batch()
    assert limits.admit("alice") is not None
    store["alice"] = 2  # a worker finished one
    limits.new_batch()
    assert limits.admit("alice") is None
    assert len(reads) == 3


def test_a_quota_refusal_spends_no_token(clock: FakeClock) -> None:
    open_now = {"alice": 1}
    limits = IngressLimits(
        clock, rate_limit=1.0, rate_burst=1, max_open_tasks=1, open_counts=lambda: open_now
    )
    limits.new_batch()
    refusal = limits.admit("alice")
    assert refusal is not None
    assert refusal.reason == QUOTA_EXCEEDED
    open_now["alice"] = 0
    limits.new_batch()
    assert limits.admit("alice") is None  # the token was still there


def test_bad_settings_are_refused(clock: FakeClock) -> None:
    with pytest.raises(ValueError, match="above 0"):
        IngressLimits(clock, rate_limit=0.0)
    with pytest.raises(ValueError, match="open_counts"):
        IngressLimits(clock, max_open_tasks=1)


def test_open_counts_are_pending_and_running_tasks_per_principal(tasks: TaskStore) -> None:
    items = [AcceptItem("alice", envelope(f"a{i}")) for i in range(3)]
    items.append(AcceptItem("bob", envelope("b0", sender="bob")))
    tasks.accept(items)
    assert tasks.open_counts() == {"alice": 3, "bob": 1}
    claimed = tasks.claim("w1", 4)
    assert tasks.open_counts() == {"alice": 3, "bob": 1}  # running is open too
    for c in claimed:
        if c.principal == "alice" and c.message_id != "a0":
            tasks.finish(c.task_id, c.owner, c.fence, {})
    tasks.cancel(next(c.task_id for c in claimed if c.principal == "bob"))
    assert tasks.open_counts() == {"alice": 1}


def _limits(args: object) -> tuple[object, ...]:
    """``run``'s three ingress limits as parsed (their ``dest`` is their path in the tree)."""
    return tuple(
        getattr(args, f"ingest.{name}") for name in ("rate_limit", "rate_burst", "max_open_tasks")
    )


def test_run_takes_the_limits_from_flags_or_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from broker_adapter.app.adapter_config import AdapterConfig
    from broker_adapter.app.cli import build_parser

    base = [
        "run",
        "--redis",
        "redis://127.0.0.1:1/0",
        "--db",
        str(tmp_path / "a.db"),
        "--handler",
        "broker_adapter.examples:echo",
    ]
    monkeypatch.setenv("BA_RATE_LIMIT", "2.5")
    monkeypatch.setenv("BA_MAX_OPEN_TASKS", "7")
    args = build_parser().parse_args([*base, "--rate-burst", "9"])
    assert _limits(args) == (2.5, 9, 7)
    monkeypatch.delenv("BA_RATE_LIMIT")
    monkeypatch.delenv("BA_MAX_OPEN_TASKS")
    args = build_parser().parse_args(base)
    assert _limits(args) == (None, None, None)
    with pytest.raises(ValueError, match="greater than 0"):
        AdapterConfig(
            redis_url="redis://x",
            db_path=tmp_path,
            handler="m:f",
            ingest={"mode": "acl", "acl_principals": ("a",), "rate_limit": 0},
        )
