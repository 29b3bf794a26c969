"""Handlers that reach the fake target (``tests.support.fake_target``) named by their
payload's ``"target"`` URL, for the side-effect tests of the worker (in its own process).

* ``keyed``: an ordinary handler keying its effect by ``Task.effect_key`` (the target
  dedupes): a rerun after a crash applies it once.
* ``irreversible``: declared ``@side_effect("apply", reconcile=..., compensate=...)``; with
  ``"twice": true`` in its payload its HTTP client "retries" a lost answer, so a target
  that does not dedupe applies the effect twice; with ``"hang_after": true`` it never
  returns once the effect is applied (its worker is killed there: the answer is lost).
* ``approved``: an irreversible effect that ``requires_approval`` on the payload's
  ``"server"`` in scope ``"restart"``.
* ``cancellable``: an ordinary handler that runs until its task's cancel is seen (asking
  ``Task.cancelled()``), then raises.
* ``fenced``: an ordinary handler whose write is fenced at the target (its task id and
  fence); with ``"freeze_first": true`` its first attempt SIGSTOPs its own process right
  before the write (a worker frozen mid-handler: a zombie once it is resumed).
"""

from __future__ import annotations

import os
import signal
from typing import Any

from broker_adapter.handler.effects import Observation, side_effect
from broker_adapter.handler.task import Task
from broker_adapter.store.task_types import ClaimedTask
from tests.support.fake_target import FakeTargetClient

ACTION = "apply"


def _client(payload: dict[str, Any]) -> FakeTargetClient:
    return FakeTargetClient(str(payload["target"]))


def reconcile(task: ClaimedTask, key: str) -> Observation:
    applied = _client(task.payload).effects(key)
    if not applied:
        return Observation.not_happened(f"no effect under {key}")
    ids = [e["effect_id"] for e in applied]
    return Observation.happened({"effect_ids": ids}, applied=len(ids))


def compensate(task: ClaimedTask, seen: Observation) -> Any:
    client = _client(task.payload)
    extra = list(seen.result["effect_ids"][1:])
    return {"compensated": [i for i in extra if client.compensate(i)]}


def _apply(task: Task) -> dict[str, Any]:
    key = task.effect_key(ACTION)
    client = _client(task.payload)
    if task.payload.get("twice"):
        try:
            client.apply(task.payload.get("value"), key=key, drop_response=True)
        except OSError:
            pass  # the answer was lost: the client sends the request again
        except Exception as exc:  # http.client raises its own errors for a dropped answer
            if not type(exc).__module__.startswith("http"):
                raise
    answer = client.apply(task.payload.get("value"), key=key)
    if task.payload.get("hang_after"):
        task.wait_cancelled(None)  # until its worker is killed
    return {"effect_id": answer["effect_id"]}


def keyed(task: Task) -> dict[str, Any]:
    return _apply(task)


@side_effect(ACTION, reconcile=reconcile, compensate=compensate)
def irreversible(task: Task) -> dict[str, Any]:
    return _apply(task)


@side_effect(
    ACTION,
    reconcile=reconcile,
    requires_approval=True,
    approval=lambda t: (str(t.payload["server"]), "restart"),
)
def approved(task: Task) -> dict[str, Any]:
    return _apply(task)


def cancellable(task: Task) -> None:
    while not task.cancelled():  # asks the store: a requested cancel is seen here
        task.wait_cancelled(0.05)
    raise RuntimeError("stopped on its cancel")


def fenced(task: Task) -> dict[str, Any]:
    if task.payload.get("freeze_first") and task.attempt == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen here until a SIGCONT
    answer = _client(task.payload).apply(
        {"attempt": task.attempt}, fence_key=task.task_id, fence=task.fence
    )
    return {"effect_id": answer["effect_id"]}
