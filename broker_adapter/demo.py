"""The demo behind ``make demo``: the durable core's guarantees, shown on a throwaway database."""

from __future__ import annotations

import tempfile
from pathlib import Path

from broker_adapter.clock import FakeClock
from broker_adapter.envelope import Envelope
from broker_adapter.errors import StaleError
from broker_adapter.store import AcceptItem, OutboxStore, TaskStore, open_database


def run_demo() -> int:
    with tempfile.TemporaryDirectory(prefix="ba-demo-") as tmp:
        clock = FakeClock()
        db = open_database(Path(tmp) / "demo.db")
        tasks, outbox = TaskStore(db, clock), OutboxStore(db, clock)
        env = Envelope.build(
            message_id="restart-web-1",
            sender="planner",
            payload={"action": "restart", "service": "web"},
            deadline=clock.now() + 300,
        )
        print("1. agent 'planner' sends restart-web-1 three times (a resend storm)")
        results = tasks.accept([AcceptItem("planner", env)] * 3)
        print("   outcomes:", ", ".join(r.outcome for r in results))
        (first,) = tasks.claim("worker-A", 1)
        print(f"2. worker-A claims it: attempt {first.attempt}, fence {first.fence}")
        clock.advance(tasks.policy.lease_s + 1)
        print("3. worker-A stalls past its lease; worker-B reclaims")
        (second,) = tasks.claim("worker-B", 1)
        print(f"   worker-B: attempt {second.attempt}, fence {second.fence}")
        try:
            tasks.finish(first.task_id, "worker-A", first.fence, {"restarted": True})
        except StaleError as exc:
            print(f"4. worker-A wakes up and tries to commit: refused ({exc.reason})")
        reply_id = tasks.finish(second.task_id, "worker-B", second.fence, {"restarted": True})
        print(f"5. worker-B commits; one reply in the outbox: {reply_id}")
        counts = outbox.counts()
        print(f"   outbox: {counts['pending']} pending reply, tasks: {tasks.counts()['done']} done")
        db.close()
    return 0
