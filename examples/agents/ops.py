"""The ops agent: it restarts services for other agents, after asking the planner to
confirm, served by its own adapter.

The restart is the effect that must happen once. It is written to the "world" (a SQLite
table standing for the service manager) under the task's idempotency key, which every
attempt of one request shares: a second attempt after a crash finds it done.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from pydantic import BaseModel

from broker_adapter import Client, Keyring, Router, Task

router = Router()


class Restart(BaseModel):
    service: str


def _world() -> sqlite3.Connection:
    conn = sqlite3.connect(os.environ["AGENTS_WORLD"], timeout=30)
    conn.execute("CREATE TABLE IF NOT EXISTS restarts (key TEXT PRIMARY KEY, service TEXT)")
    return conn


@router.task("restart", payload=Restart)
def restart(task: Task) -> dict[str, object]:
    """Restart a service, once, after the planner confirms it."""
    keyring = Keyring.load(os.environ["AGENTS_KEYRING"])
    with Client(os.environ["AGENTS_REDIS"], "ops", keyring, prefix="planner") as planner:
        key = f"confirm/{task.idempotency_key}"  # the same question on every attempt
        # a retry finds the answer an earlier attempt got; asking again would send a new
        # deadline under the same message id, which the planner refuses as a conflict
        answer = planner.result(planner.message_id(key=key)) or planner.request(
            "confirm", {"service": task.args.service, "asked_by": task.principal},
            key=key, timeout_s=60,
        )  # fmt: skip
    if answer.result.get("ok") is not True:
        return {"restarted": False, "why": "the planner did not confirm"}
    with _world() as world:  # the effect, keyed: a second attempt adds nothing
        world.execute("INSERT OR IGNORE INTO restarts VALUES (?, ?)",
                      (task.idempotency_key, task.args.service))  # fmt: skip
    Path(os.environ["AGENTS_STEPS"], f"restarted-attempt-{task.attempt}").touch()
    while task.attempt == 1 and not task.cancelled():  # the story kills the agent here
        time.sleep(0.05)
    return {"restarted": True, "service": task.args.service, "attempt": task.attempt}
