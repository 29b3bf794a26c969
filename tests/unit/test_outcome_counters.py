"""Counters that never fall (``store.counters``): read before and after a purge, none falls;
an attempt counts when its claim commits (a worker that dies after it still counted it);
every durable transition to ``unknown`` counts, the lease take-back's included. On SQLite
and PostgreSQL, on a FakeClock; exported by the metrics collector."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_adapter.app.metrics import AdapterCollector, Observed
from broker_adapter.clock import FakeClock
from broker_adapter.handler.effects import EffectSpec, Observation
from broker_adapter.stages.reconcile.reconciler import ReconcilePolicy, Reconciler
from broker_adapter.store import outcome_schema
from broker_adapter.store.counters import monotonic_counts
from broker_adapter.store.db import open_database
from broker_adapter.store.effects import EffectsStore
from broker_adapter.store.report import snapshot
from broker_adapter.store.settle import Settlement
from broker_adapter.store.task_types import ClaimedTask
from tests.support.store_script import LEASE_S, RETENTION_S, Stores, item, open_any, stores

POLICY = ReconcilePolicy(lease_s=20.0)
COUNTERS = (
    "task_attempts",
    "task_outcomes_unknown",
    "reconciled_done",
    "reconciled_not-done",
    "reconciled_unknown",
    "compensations_started",
    "compensations_done",
    "compensations_failed",
    "operator_timeouts_alert",
    "operator_timeouts_fail",
)
EXPORTED = {
    "ba_task_attempts_total": "task_attempts",
    'ba_task_outcomes_total{outcome="unknown"}': "task_outcomes_unknown",
    'ba_reconciles_total{outcome="done"}': "reconciled_done",
    'ba_reconciles_total{outcome="not-done"}': "reconciled_not-done",
    'ba_compensations_total{outcome="started"}': "compensations_started",
    'ba_compensations_total{outcome="done"}': "compensations_done",
}


@pytest.fixture
def target(store_target: str) -> str:
    return store_target


@pytest.fixture
def s(target: str, clock: FakeClock) -> Iterator[Stores]:
    with open_any(target) as db:
        yield stores(db, clock)


def counters(s: Stores, clock: FakeClock) -> dict[str, int]:
    fx = snapshot(s.db, clock.now())["effects"]
    return {name: int(fx[name]) for name in COUNTERS}


def exported(target: str) -> dict[str, float]:
    """The samples of ``EXPORTED`` a scrape of the database gives."""
    got: dict[str, float] = {}
    for family in AdapterCollector(Observed(db_path=target)).collect():
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            got[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return {name: got[name] for name in EXPORTED}


def started(s: Stores, fx: EffectsStore, mid: str) -> ClaimedTask:
    s.tasks.accept([item(mid)])
    (task,) = s.tasks.claim("w1")
    fx.mark_effect_started(task.task_id, "w1", task.fence)
    return task


def send_all(s: Stores) -> None:
    rows = s.outbox.claim("d1", 1000)
    marks, _ = s.outbox.mark_sent_and_claim("d1", [(r.reply_id, r.fence, "1-0") for r in rows], 0)
    assert marks == [None] * len(rows)


def test_counters_read_before_and_after_a_purge_never_fall(
    s: Stores, clock: FakeClock, target: str
) -> None:
    fx = EffectsStore(s.tasks.tx)
    applied: dict[str, int] = {}

    def reconcile(task: ClaimedTask, key: str) -> Observation:
        n = applied.get(task.message_id, 0)
        return Observation.happened({"n": n}, applied=n) if n else Observation.not_happened()

    spec = EffectSpec("restart", reconcile=reconcile, compensate=lambda task, seen: "undone")
    # m1: its worker dies after the effect (applied twice); the take-back sends it to unknown
    dead = started(s, fx, "m1")
    applied["m1"] = 2
    clock.advance(LEASE_S)
    assert s.tasks.reconcile()["unknown"] == 1
    # m2: timed out before its effect reached the target; reconciled not-done, run again
    m2 = started(s, fx, "m2")
    fx.to_unknown(m2.task_id, "w1", m2.fence, "timed out")
    reconciler = Reconciler(fx, spec, "r1", POLICY)
    assert reconciler.run_once() == 2
    assert (reconciler.stats.done, reconciler.stats.not_done) == (1, 1)
    (again,) = s.tasks.claim("w1")
    assert again.task_id == m2.task_id
    s.tasks.settle_batch([Settlement(again.task_id, "w1", again.fence, result="1")], "", 0)
    send_all(s)
    before = counters(s, clock)
    assert before["task_attempts"] == 3  # m1 once (its worker died), m2 twice
    assert before["task_outcomes_unknown"] == 2  # the take-back's and the holder's
    assert (before["reconciled_done"], before["reconciled_not-done"]) == (1, 1)
    assert (before["compensations_started"], before["compensations_done"]) == (1, 1)
    scraped = exported(target)
    assert scraped == {name: before[key] for name, key in EXPORTED.items()}
    clock.advance(2 * RETENTION_S)  # past every deadline and the window
    assert s.tasks.purge() == 2
    assert fx.reconcile_log(dead.task_id) == []  # the records went with the tasks
    assert fx.compensations(dead.task_id) == []
    after = counters(s, clock)
    fallen = {k: (before[k], after[k]) for k in COUNTERS if after[k] < before[k]}
    assert not fallen, fallen
    assert after == before  # nothing happened meanwhile: the same values
    assert exported(target) == scraped


def test_an_attempt_counts_at_its_claims_commit(s: Stores, clock: FakeClock) -> None:
    s.tasks.accept([item("m1"), item("m2")])
    assert counters(s, clock)["task_attempts"] == 0
    s.tasks.claim("w1", 2)  # the worker may die right after: both attempts are counted
    assert counters(s, clock)["task_attempts"] == 2
    clock.advance(LEASE_S)
    assert len(s.tasks.claim("w2", 2)) == 2  # taken back and claimed again
    assert counters(s, clock)["task_attempts"] == 4


def test_the_lease_take_back_to_unknown_counts_at_the_lease_edge(
    s: Stores, clock: FakeClock
) -> None:
    fx = EffectsStore(s.tasks.tx)
    started(s, fx, "m1")
    clock.advance(LEASE_S - 0.001)
    assert s.tasks.claim("w2") == []  # the lease holds: nothing taken back
    assert counters(s, clock)["task_outcomes_unknown"] == 0
    clock.advance(0.001)
    assert s.tasks.claim("w2") == []  # taken back inside the claim, to unknown, not claimed
    assert counters(s, clock)["task_outcomes_unknown"] == 1
    assert s.tasks.counts()["unknown"] == 1


def test_a_refused_transition_counts_nothing(s: Stores, clock: FakeClock) -> None:
    from broker_adapter.errors import StaleError

    fx = EffectsStore(s.tasks.tx)
    task = started(s, fx, "m1")
    with pytest.raises(StaleError):
        fx.to_unknown(task.task_id, "w1", task.fence + 1, "a zombie's")
    assert counters(s, clock)["task_outcomes_unknown"] == 0


def test_the_upgrade_seeds_the_counters_from_the_records_kept(tmp_path: Path) -> None:
    """A database made before the counters: the migration (``outcome_schema``, run again
    on a database whose counters table is not there yet) starts them from what its records
    held, so the exported counters do not fall at the upgrade."""
    path = tmp_path / "old.db"
    open_database(path).close()
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("DROP TABLE counters")  # as before the migration
        conn.execute(
            "INSERT INTO reconcile_log (task_id, outcome, by_whom, at, fence) VALUES"
            " ('t1', 'done', 'r', 1, 1), ('t2', 'done', 'r', 1, 1), ('t3', 'not-done', 'r', 1, 1)"
        )
        conn.execute(
            "INSERT INTO compensations (task_id, kind, by_whom, fence, what, started_at,"
            " outcome) VALUES ('t1', 'duplicate', 'r', 1, 'x', 1, 'done'),"
            " ('t2', 'duplicate', 'r', 1, 'x', 1, 'started')"
        )
        outcome_schema.sqlite_migration(conn)
        outcome_schema.sqlite_migration(conn)  # idempotent, like every migration
    conn.close()
    with open_database(path) as db, db.read() as c:
        got = monotonic_counts(c)
    assert (got["reconciled_done"], got["reconciled_not-done"]) == (2, 1)
    assert (got["compensations_started"], got["compensations_done"]) == (2, 1)
    assert got["task_attempts"] == 0
