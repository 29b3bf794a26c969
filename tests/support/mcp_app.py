"""The router the MCP tests serve, importable in worker processes.

Every handler call appends a line to the file named by ``BA_TEST_CALLS``; ``hold`` waits
(polling, as a handler waiting on an outside system would) while the file named by its
payload's ``gate`` exists, so a test decides when it finishes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pydantic import BaseModel, Field

from broker_adapter import Router, Task

router = Router()


class Restart(BaseModel):
    service: str = Field(min_length=1, max_length=64)


class Hold(BaseModel):
    gate: str
    label: str = ""


def _note(what: str) -> None:
    path = os.environ.get("BA_TEST_CALLS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(what + "\n")


@router.task("restart", payload=Restart)
async def restart(task: Task) -> dict[str, str]:
    """Restart a service by name."""
    _note(f"restart {task.args.service}")
    return {"restarted": task.args.service}


@router.task("explode")
def explode(task: Task) -> dict[str, str]:
    """Fail, always."""
    _note("explode")
    raise ValueError("the service is on fire")


@router.task("hold", payload=Hold)
def hold(task: Task) -> dict[str, str]:
    """Wait until the test opens the gate (or the task is cancelled)."""
    _note(f"hold {task.args.label}")
    while Path(task.args.gate).exists():
        if task.cancelled():
            return {"stopped": task.args.label}
        time.sleep(0.05)  # waiting on an outside system: the test's gate file
    return {"released": task.args.label}


def calls(path: Path) -> list[str]:
    """The notes the handlers wrote."""
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []
