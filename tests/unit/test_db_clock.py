"""One clock for leases (``store.dbclock``): on PostgreSQL the stores judge leases,
deadlines and expiries by the server's clock, so a host whose clock is wrong neither takes
a held lease early nor commits past its own; SQLite (one host) keeps the process clock.

The hosts here are stores with a ``SkewedClock`` (the real clock off by a minute) on one
database; a lease's end is moved with SQL to either side of the server's "now", so no test
waits for time to pass."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from broker_adapter.errors import StaleError
from broker_adapter.store import AcceptItem, Outcome, TaskStore
from broker_adapter.store.dbclock import (
    SERVER_NOW,
    SKEW_WARN_S,
    clock_report,
    clock_skew,
    read_now,
    report_clock_skew,
)
from broker_adapter.store.postgres.db import PgDatabase
from broker_adapter.store.task_types import TaskPolicy
from tests.support.clocks import SkewedClock
from tests.support.store_script import AnyDatabase, envelope, open_any

LEASE_S = 30.0
MINUTE = 60.0


@pytest.fixture
def pg(pg_url: str) -> Iterator[PgDatabase]:
    db = open_any(pg_url)
    assert isinstance(db, PgDatabase)
    with db:
        yield db


def _store(db: AnyDatabase, offset_s: float) -> TaskStore:
    """A store on a host whose clock is ``offset_s`` ahead of the real one."""
    return TaskStore(db, SkewedClock(offset_s), TaskPolicy(lease_s=LEASE_S))


def _accept(store: TaskStore, mid: str) -> str:
    env = envelope(mid, deadline=time.time() + 600)
    (res,) = store.accept([AcceptItem("alice", env)])
    assert res.outcome is Outcome.STORED, res
    assert res.task_id is not None
    return res.task_id


def _server_now(db: AnyDatabase) -> float:
    row = db.fetch_one(SERVER_NOW)
    assert row is not None
    return float(row["now"])


def _lease_ends(db: AnyDatabase, task_id: str, at: float) -> None:
    with db.write("test") as c:
        c.execute("UPDATE tasks SET lease_until = ? WHERE task_id = ?", (at, task_id))


# -- measuring the skew ---------------------------------------------------------------------


@pytest.mark.parametrize("offset_s", [MINUTE, -MINUTE, 0.0])
def test_clock_skew_is_the_hosts_distance_from_the_server(pg: PgDatabase, offset_s: float) -> None:
    skew = clock_skew(pg, SkewedClock(offset_s))
    assert skew is not None
    assert abs(skew - offset_s) < 1.0  # server and test on one machine: one clock
    assert clock_report(pg)["source"] == "database server"


def test_sqlite_has_no_server_clock_and_no_skew(tmp_path: object) -> None:
    with open_any(f"{tmp_path}/store.db") as db:
        assert clock_skew(db, SkewedClock(MINUTE)) is None
        assert clock_report(db) == {"source": "process", "skew_s": None}
        assert read_now(db, SkewedClock(MINUTE)) > time.time() + MINUTE - 1


@pytest.mark.parametrize(
    ("offset_s", "level"),
    [
        (SKEW_WARN_S + 1, logging.WARNING),
        (-(SKEW_WARN_S + 1), logging.WARNING),
        (SKEW_WARN_S - 1, logging.INFO),
        (0.0, logging.INFO),
    ],
)
def test_start_up_warns_above_the_bound_only(
    pg: PgDatabase, caplog: pytest.LogCaptureFixture, offset_s: float, level: int
) -> None:
    log = logging.getLogger("test.dbclock")
    with caplog.at_level(logging.INFO, logger="test.dbclock"):
        skew = report_clock_skew(pg, log, SkewedClock(offset_s))
    assert skew == pytest.approx(offset_s, abs=0.5)
    assert [r.levelno for r in caplog.records] == [level]


# -- a host ahead does not take a held lease --------------------------------------------------


def test_host_ahead_takes_no_held_lease_on_postgres(pg: PgDatabase) -> None:
    holder, ahead = _store(pg, 0.0), _store(pg, MINUTE)
    task_id = _accept(holder, "m1")
    (held,) = holder.claim("holder")
    # By its own clock the lease ended 30 s ago; by the server's it has 30 s left.
    assert ahead.clock.now() > held.lease_until
    assert ahead.claim("ahead") == []
    assert ahead.has_work() is False
    assert ahead.reconcile() == {"expired": 0, "requeued": 0, "exhausted": 0}
    assert ahead.refusal(task_id, "holder", held.fence) is None
    # ... and once the server's clock says the lease ended, it is taken back at once.
    _lease_ends(pg, task_id, _server_now(pg) - 0.01)
    assert ahead.has_work() is True
    (taken,) = ahead.claim("ahead")
    assert (taken.task_id, taken.fence, taken.attempt) == (task_id, held.fence + 1, 2)
    assert taken.lease_until == pytest.approx(_server_now(pg) + LEASE_S, abs=1.0)


def test_host_ahead_does_take_a_lease_on_sqlite_one_host_one_clock(tmp_path: object) -> None:
    """SQLite keeps the process clock: a second clock on one file is a test's fiction."""
    with open_any(f"{tmp_path}/store.db") as db:
        holder, ahead = _store(db, 0.0), _store(db, MINUTE)
        task_id = _accept(holder, "m1")
        (held,) = holder.claim("holder")
        (taken,) = ahead.claim("ahead")
        assert (taken.task_id, taken.fence) == (task_id, held.fence + 1)


# -- a host behind does not commit past its lease ---------------------------------------------


@pytest.mark.parametrize("offset_s", [-MINUTE, 0.0])
def test_host_behind_commits_only_within_its_lease_on_postgres(
    pg: PgDatabase, offset_s: float
) -> None:
    behind = _store(pg, offset_s)
    task_id = _accept(behind, "m1")
    (held,) = behind.claim("behind")
    # Inside the lease by the server's clock: the commit holds.
    _lease_ends(pg, task_id, _server_now(pg) + 5.0)
    assert behind.renew(task_id, "behind", held.fence) == pytest.approx(
        _server_now(pg) + LEASE_S, abs=1.0
    )
    # Past it by the server's clock (by its own, still 30 s or a minute and a half left):
    # renewal, failure and success are all refused.
    _lease_ends(pg, task_id, _server_now(pg) - 0.01)
    assert behind.clock.now() < _server_now(pg) + 1.0 + offset_s
    for attempt in (
        lambda: behind.renew(task_id, "behind", held.fence),
        lambda: behind.fail(task_id, "behind", held.fence, "x", retryable=True),
        lambda: behind.finish(task_id, "behind", held.fence, {"late": True}),
    ):
        with pytest.raises(StaleError) as refused:
            attempt()
        assert refused.value.reason == "lease_expired"
    row = behind.get(task_id)
    assert row is not None
    assert row.state == "running"
    # A second task committed within its lease is done, its times on the server's clock.
    other = _accept(behind, "m2")
    (claim,) = behind.claim("behind")
    assert claim.task_id == other
    behind.finish(other, "behind", claim.fence, {"ok": True})
    done = behind.get(other)
    assert done is not None
    assert done.state == "done"
    assert done.finished_at == pytest.approx(_server_now(pg), abs=1.0)
