"""A ``Router`` of named tasks for the router tests, importable in worker processes.

Each call appends one line to the file named by ``BA_TEST_CALLS`` (when set): ``start`` or
``end``, the task name, message id, attempt, owner and process id, so a test can count the
calls each request got and where they ran.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from pydantic import BaseModel, Field

from broker_adapter import Observation, side_effect
from broker_adapter.handler.router import Router
from broker_adapter.handler.task import Task
from broker_adapter.store.task_types import ClaimedTask

router = Router()


class Nap(BaseModel):
    """How long to sleep: ``seconds`` on the first attempt, ``later_s`` on the others."""

    seconds: float = Field(ge=0, le=60)
    later_s: float = Field(default=0.0, ge=0, le=60)


class Greeting(BaseModel):
    name: str = Field(min_length=1)
    times: int = Field(default=1, ge=1, le=5)


class Greeted(BaseModel):
    text: str


def _note(what: str, task: Task) -> None:
    path = os.environ.get("BA_TEST_CALLS")
    if not path:
        return
    fields = {
        "what": what,
        "task": task.task_name,
        "message_id": task.message_id,
        "attempt": task.attempt,
        "owner": task.owner,
        "pid": os.getpid(),
    }
    line = json.dumps(fields)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def calls(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The lines ``_note`` wrote (none if the file does not exist yet)."""
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


@router.task("nap", payload=Nap, default=True)
async def nap(task: Task) -> dict[str, Any]:
    """Sleep (an async wait, as a call to a model or an API would be)."""
    args: Nap = task.args
    _note("start", task)
    await asyncio.sleep(args.seconds if task.attempt == 1 else args.later_s)
    _note("end", task)
    return {"slept": args.seconds, "attempt": task.attempt}


@router.task("greet", payload=Greeting)
def greet(task: Task) -> Greeted:
    """Greet someone, ``times`` times."""
    args: Greeting = task.args
    _note("start", task)
    _note("end", task)
    return Greeted(text=" ".join([f"hello {args.name}"] * args.times))


def _charged(task: ClaimedTask, key: str) -> Observation:
    """The charge happened when its handler started it (the calls file says so)."""
    path = os.environ.get("BA_TEST_CALLS", "")
    started = [c for c in calls(path) if c["message_id"] == task.message_id]
    if started:
        return Observation.happened({"charged": True, "seen_by": "reconcile"})
    return Observation.not_happened()


@router.task("charge", payload=Nap)
@side_effect("charge", reconcile=_charged)
async def charge(task: Task) -> dict[str, Any]:
    """An effect that cannot be taken back: started before the call (irreversible)."""
    args: Nap = task.args
    _note("start", task)
    await asyncio.sleep(args.seconds if task.attempt == 1 else args.later_s)
    _note("end", task)
    return {"charged": True}
