"""README and docs/EFFECTS.md, "Side effects you cannot roll back": the three snippets, with
stand-ins for the payment service (``httpx``, ``pay``), its refund, the target's connection
and a task."""

import sqlite3
from types import SimpleNamespace

from broker_adapter import SqlFence, Task

httpx = SimpleNamespace(post=lambda url, json, headers: SimpleNamespace(json=lambda: {"id": "ch_1"}))
pay = SimpleNamespace(find_charges=lambda idempotency_key: [])


def refund_extra(task, key, observation):
    return {"refunded": 0}


conn = sqlite3.connect(":memory:")
conn.execute(SqlFence().create_sql())
conn.execute("CREATE TABLE servers (name TEXT PRIMARY KEY, state TEXT)")
task = SimpleNamespace(task_id="t-1", fence=1)


def charge(task: Task) -> dict:
    key = task.effect_key("charge_card", {"amount": task.payload["amount"]})
    r = httpx.post("https://pay.example/charges", json=task.payload,
                   headers={"Idempotency-Key": key})     # the target applies a key once
    return {"charge_id": r.json()["id"]}


from broker_adapter import Observation, side_effect

def charged(task, key):                       # ask the target what it did under the key
    found = pay.find_charges(idempotency_key=key)
    if not found:
        return Observation.not_happened()
    return Observation.happened({"charge_ids": [c.id for c in found]}, applied=len(found))

@side_effect("charge_card", reconcile=charged, compensate=refund_extra)
def charge(task): ...


fence = SqlFence()
with conn:                                     # the target's own transaction
    fence.advance(conn.cursor(), task.task_id, task.fence)   # TargetFenced: rolled back
    conn.execute("UPDATE servers SET state = 'restarting' WHERE name = ?", ("web1",))

print("effects ok:", charged(task, "k").outcome)
