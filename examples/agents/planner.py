"""The planner agent: it asks the ops agent to restart a service, and it answers the ops
agent's question back (``confirm``), served by its own adapter."""

from __future__ import annotations

import os

from pydantic import BaseModel

from broker_adapter import Client, Keyring, Router, Task

router = Router()


class Confirm(BaseModel):
    service: str
    asked_by: str


@router.task("confirm", payload=Confirm)
def confirm(task: Task) -> dict[str, bool]:
    """Say whether the planner still wants ``service`` restarted."""
    return {"ok": task.args.service in {"web", "api"}}


def ask_for_restart(service: str) -> dict[str, object]:
    """Ask the ops agent, await its answer. The key names this request for good: asked
    again (after a crash of this process, say), it is the same request, not a second one."""
    keyring = Keyring.load(os.environ["AGENTS_KEYRING"])
    with Client(os.environ["AGENTS_REDIS"], "planner", keyring, prefix="ops") as ops:
        reply = ops.request("restart", {"service": service}, key=f"incident-42/{service}",
                            timeout_s=120)  # fmt: skip
    return dict(reply.result)
