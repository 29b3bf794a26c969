"""``broker-adapter reconcile list`` and ``reconcile show TASK_ID`` (a subprocess on a real
SQLite file): the unknown tasks, those waiting for an operator first, and one task's
reconcile log and compensations with their evidence; the answering form keeps its name."""

from __future__ import annotations

import json
from pathlib import Path

from broker_adapter.handler.effects import EffectSpec
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.stages.reconcile.reconciler import ReconcilePolicy, Reconciler
from broker_adapter.store import TaskStore
from broker_adapter.store.db import open_database
from broker_adapter.store.effects import EffectsStore
from broker_adapter.store.evidence import key_digest
from broker_adapter.store.inbox import AcceptItem
from tests.support.cli import error_line
from tests.support.cli import run_cli as _cli


def _unknown(store: TaskStore, mid: str) -> str:
    envelope = Envelope.build(
        message_id=mid, sender="agent-a", payload={"server": mid}, deadline=store.clock.now() + 600
    )
    store.accept([AcceptItem("agent-a", envelope)])
    (claimed,) = store.claim("w1")
    fx = EffectsStore(store.tx)
    key = EffectSpec("restart").key(claimed)
    fx.mark_effect_started(claimed.task_id, "w1", claimed.fence, key_digest=key_digest(key))
    fx.to_unknown(claimed.task_id, "w1", claimed.fence, "timeout")
    return claimed.task_id


def test_reconcile_list_and_show(tmp_path: Path) -> None:
    path = tmp_path / "ops.db"
    with open_database(path) as db:
        store = TaskStore(db)
        reconciled = _unknown(store, "m1")
        waiting = _unknown(store, "m2")
        fx = EffectsStore(store.tx)
        policy = ReconcilePolicy(max_tries=1)
        Reconciler(fx, EffectSpec("restart"), "r1", policy).run_once()  # both: operator
        fx.operator_resolve(reconciled, "not-done", "carol")  # back to pending
    listed = _cli("reconcile", "--db", str(path), "list")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [r["task_id"] for r in rows] == [waiting]
    assert rows[0]["operator_since"] is not None
    assert rows[0]["effect_key_digest"] is not None
    assert len(rows[0]["effect_key_digest"]) == 64
    shown = _cli("reconcile", "--db", str(path), "show", waiting)
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    assert record["task"]["state"] == "unknown"
    (log,) = record["reconcile_log"]
    assert (log["outcome"], log["by_whom"]) == ("unknown", "r1")
    assert log["effect_key_digest"] == record["task"]["effect_key_digest"]
    assert log["adapter_version"] == record["task"]["adapter_version"]
    assert record["compensations"] == []
    other = json.loads(_cli("reconcile", "--db", str(path), "show", reconciled).stdout)
    assert [r["outcome"] for r in other["reconcile_log"]] == ["unknown", "not-done"]
    assert other["reconcile_log"][1]["by_whom"] == "carol"
    missing = _cli("reconcile", "--db", str(path), "show", "t-nope")
    assert missing.returncode == 1
    assert json.loads(missing.stdout)["error"] == "no such task"
    assert "needs the task" in error_line(_cli("reconcile", "--db", str(path), "show"), 2)
    answer = _cli("reconcile", "--db", str(path), waiting, "--by", "carol")
    assert "--outcome" in error_line(answer, 2)
