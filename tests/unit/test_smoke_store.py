"""Smoke test of the store's happy path (the full suite lives beside it)."""

from __future__ import annotations

from pathlib import Path

from broker_adapter.clock import FakeClock
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.store import AcceptItem, OutboxStore, Outcome, TaskStore, open_database


def test_store_accept_claim_finish_writes_one_reply(tmp_path: Path, clock: FakeClock) -> None:
    db = open_database(tmp_path / "s.db")
    tasks, outbox = TaskStore(db, clock), OutboxStore(db, clock)
    env = Envelope.build(message_id="m1", sender="a", payload={"x": 1}, deadline=clock.now() + 60)
    (res,) = tasks.accept([AcceptItem("a", env)])
    assert res.outcome is Outcome.STORED
    (task,) = tasks.claim("w1", 10)
    assert (task.attempt, task.fence) == (1, 1)
    reply_id = tasks.finish(task.task_id, "w1", task.fence, {"ok": True})
    rows = outbox.list()
    assert [r.reply_id for r in rows] == [reply_id]
    assert rows[0].status == "done"
