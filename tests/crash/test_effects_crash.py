"""Workers SIGKILLed around an external effect at the fake target (its own process, its own
SQLite file): what reached the target, and what the task became.

Each worker is a ``tests.support.worker_script drain`` subprocess on a FakeClock fixed at
``--now`` (a later ``--now`` is "after the lease"); the handlers are
``tests.support.effect_handlers``. The reconciler runs in the test, on the same database,
with the handler's own declaration.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from broker_adapter.app.ops import collect_status, format_status
from broker_adapter.clock import FakeClock
from broker_adapter.handler.effects import effect_spec
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.idempotency import Intent, action_key
from broker_adapter.stages.reconcile.reconciler import ReconcilePolicy, Reconciler
from broker_adapter.stages.shared.handlers import load_handler
from broker_adapter.store import AcceptItem, Database, OutboxStore, TaskStore, open_database
from broker_adapter.store.effects import EffectsStore
from broker_adapter.store.task_types import TaskPolicy, TaskRow
from tests.support import effect_handlers
from tests.support.cli import wait_for
from tests.support.fake_target import FakeTarget, FakeTargetClient

pytestmark = pytest.mark.crash

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_800_000_000.0
LEASE_S = 30.0
AFTER_LEASE = T0 + LEASE_S + 1
WAIT_S = 60.0
IRREVERSIBLE = "tests.support.effect_handlers:irreversible"
KEYED = "tests.support.effect_handlers:keyed"
FENCED = "tests.support.effect_handlers:fenced"


class Setup:
    def __init__(self, tmp_path: Path, target: FakeTargetClient) -> None:
        self.db_path = tmp_path / "tasks.db"
        self.target = target
        self.dbs: list[Database] = []

    def submit(self, **payload: Any) -> str:
        envelope = Envelope.build(
            message_id="m1",
            sender="agent-a",
            payload={"target": self.target.url, "value": 1, **payload},
            deadline=T0 + 3600,
        )
        with open_database(self.db_path) as db:
            (result,) = TaskStore(db, FakeClock(T0)).accept([AcceptItem("agent-a", envelope)])
        assert isinstance(result.task_id, str)
        return result.task_id

    def args(self, handler: str, owner: str, now: float) -> list[str]:
        return [
            sys.executable,
            "-m",
            "tests.support.worker_script",
            "drain",
            "--db",
            str(self.db_path),
            "--handler",
            handler,
            "--lease-s",
            str(LEASE_S),
            "--owner",
            owner,
            "--now",
            repr(now),
        ]

    def drain(self, handler: str, owner: str, now: float, **points: str) -> dict[str, int]:
        env = {k: v for k, v in os.environ.items() if k not in ("BA_CRASHPOINT", "BA_PAUSEPOINT")}
        env.update(points)
        done = subprocess.run(
            self.args(handler, owner, now),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=WAIT_S,
            check=False,
        )
        if points:
            assert done.returncode == -signal.SIGKILL, done.stderr
            return {}
        assert done.returncode == 0, done.stderr
        (line,) = [x for x in done.stdout.splitlines() if x.startswith("STATS ")]
        stats: dict[str, int] = json.loads(line.removeprefix("STATS "))
        return stats

    def task(self, task_id: str) -> TaskRow:
        with open_database(self.db_path) as db:
            row = TaskStore(db).get(task_id)
        assert row is not None
        return row

    def replies(self, task_id: str) -> list[dict[str, Any]]:
        with open_database(self.db_path) as db:
            rows = OutboxStore(db).list(limit=1000)
        return [json.loads(r.body) for r in rows if r.task_id == task_id]

    def reconcile(self, handler: str, now: float) -> tuple[Reconciler, EffectsStore]:
        spec = effect_spec(load_handler(handler))
        assert spec is not None
        db = open_database(self.db_path)
        self.dbs.append(db)
        fx = EffectsStore(TaskStore(db, FakeClock(now), TaskPolicy(lease_s=LEASE_S)).tx)
        reconciler = Reconciler(fx, spec, "reconciler", ReconcilePolicy(lease_s=LEASE_S))
        reconciler.run_once()
        return reconciler, fx

    def close(self) -> None:
        for db in self.dbs:
            db.close()


def key_of(setup: Setup) -> str:
    return action_key(
        Intent("agent-a", "m1"), effect_handlers.ACTION, {"target": setup.target.url, "value": 1}
    )


@pytest.fixture
def idempotent(tmp_path: Path) -> Iterator[Setup]:
    with FakeTarget(tmp_path / "idem") as client:
        setup = Setup(tmp_path, client)
        yield setup
        setup.close()


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[Setup]:
    with FakeTarget(tmp_path / "plain", idempotent=False) as client:
        setup = Setup(tmp_path, client)
        yield setup
        setup.close()


def test_keyed_effect_killed_after_it_is_applied_once(idempotent: Setup) -> None:
    task_id = idempotent.submit()
    idempotent.drain(KEYED, "w1", T0, BA_CRASHPOINT="worker.after_effect")
    assert idempotent.task(task_id).state == "running"
    stats = idempotent.drain(KEYED, "w2", AFTER_LEASE)
    assert stats["done"] == 1
    assert idempotent.task(task_id).state == "done"
    assert len(idempotent.target.effects(key_of(idempotent))) == 1
    assert len(idempotent.target.effects()) == 1


def test_irreversible_no_dedupe_killed_after_the_start_is_unknown_then_reconciled_done(
    plain: Setup,
) -> None:
    task_id = plain.submit()
    plain.drain(IRREVERSIBLE, "w1", T0, BA_CRASHPOINT="worker.after_effect")
    assert len(plain.target.effects()) == 1
    counted = collect_status(plain.db_path, None, "ba")["effects"]
    # the SIGKILLed worker's attempt counted when its claim committed
    assert (counted["task_attempts"], counted["task_outcomes_unknown"]) == (1, 0)
    stats = plain.drain(IRREVERSIBLE, "w2", AFTER_LEASE)
    assert stats["claimed"] == 0  # not retried blindly
    row = plain.task(task_id)
    assert row.state == "unknown"
    counted = collect_status(plain.db_path, None, "ba")["effects"]
    # the take-back to unknown, by w2's claim transaction, counted with it
    assert (counted["task_attempts"], counted["task_outcomes_unknown"]) == (1, 1)
    reconciler, fx = plain.reconcile(IRREVERSIBLE, AFTER_LEASE)
    assert reconciler.stats.done == 1
    (effect,) = plain.target.effects()  # no second call
    row = plain.task(task_id)
    assert row.state == "done"
    assert row.attempts == 1
    (reply,) = plain.replies(task_id)
    assert reply["status"] == "done"
    assert reply["result"] == {"effect_ids": [effect["effect_id"]]}
    assert [r.outcome for r in fx.reconcile_log(task_id)] == ["done"]
    assert reply["effects"]["reconciled"] == {
        "outcome": "done",
        "by": "reconciler",
        "note": None,
        "tries": 0,
    }
    assert "compensations" not in reply["effects"]


def test_killed_after_the_start_before_the_effect_is_reconciled_not_done_and_retried_once(
    plain: Setup,
) -> None:
    task_id = plain.submit()
    plain.drain(IRREVERSIBLE, "w1", T0, BA_CRASHPOINT="store.effect_started.after_commit")
    assert plain.target.effects() == []
    plain.drain(IRREVERSIBLE, "w2", AFTER_LEASE)
    assert plain.task(task_id).state == "unknown"
    reconciler, _ = plain.reconcile(IRREVERSIBLE, AFTER_LEASE)
    assert reconciler.stats.not_done == 1
    assert plain.task(task_id).state == "pending"
    stats = plain.drain(IRREVERSIBLE, "w3", AFTER_LEASE)
    assert (stats["claimed"], stats["done"]) == (1, 1)
    row = plain.task(task_id)
    assert (row.state, row.attempts) == ("done", 2)
    assert len(plain.target.effects()) == 1
    assert len(plain.replies(task_id)) == 1


def test_a_duplicate_at_a_non_idempotent_target_is_compensated_once_and_audited(
    plain: Setup,
) -> None:
    task_id = plain.submit(twice=True)
    plain.drain(IRREVERSIBLE, "w1", T0, BA_CRASHPOINT="worker.after_effect")
    assert len(plain.target.effects()) == 2  # the lost answer's retry applied it again
    plain.drain(IRREVERSIBLE, "w2", AFTER_LEASE)
    reconciler, fx = plain.reconcile(IRREVERSIBLE, AFTER_LEASE)
    assert (reconciler.stats.done, reconciler.stats.compensations) == (1, 1)
    assert len(plain.target.effects()) == 1  # the duplicate was undone
    (record,) = fx.compensations(task_id)
    assert (record.kind, record.outcome, record.by_whom) == ("duplicate", "done", "reconciler")
    assert "2 times" in record.what
    again, fx = plain.reconcile(IRREVERSIBLE, AFTER_LEASE + LEASE_S)
    assert again.stats.outcomes == []  # nothing left to reconcile
    assert len(fx.compensations(task_id)) == 1
    assert plain.task(task_id).state == "done"
    (reply,) = plain.replies(task_id)
    (shown,) = reply["effects"]["compensations"]
    assert (shown["kind"], shown["outcome"], shown["by"]) == ("duplicate", "done", "reconciler")
    report = collect_status(plain.db_path, None, "ba")
    assert (report["effects"]["compensations_done"], report["effects"]["reconciled_done"]) == (1, 1)
    assert "compensations done 1" in format_status(report)


def test_a_zombie_workers_late_write_is_refused_at_the_target(plain: Setup) -> None:
    task_id = plain.submit(freeze_first=True)
    zombie = subprocess.Popen(
        plain.args(FENCED, "w1", T0),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        proc = psutil.Process(zombie.pid)
        wait_for(lambda: proc.status() == psutil.STATUS_STOPPED, "the worker to freeze", WAIT_S)
        stats = plain.drain(FENCED, "w2", AFTER_LEASE)  # its lease ran out: taken over
        assert stats["done"] == 1
        (effect,) = plain.target.effects()
        assert effect["fence"] == 2
        zombie.send_signal(signal.SIGCONT)  # it wakes up and writes with fence 1
        out, err = zombie.communicate(timeout=WAIT_S)
    finally:
        if zombie.poll() is None:
            zombie.kill()
            zombie.wait()
    assert zombie.returncode == 0, err
    assert "fake target answered 409" in err  # refused at the resource ...
    (line,) = [x for x in out.splitlines() if x.startswith("STATS ")]
    assert json.loads(line.removeprefix("STATS "))["stale_commits"] == 1  # ... and by us
    assert [e["fence"] for e in plain.target.effects()] == [2]
    row = plain.task(task_id)
    assert (row.state, row.fence) == ("done", 2)
