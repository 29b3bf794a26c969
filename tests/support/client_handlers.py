"""The handler the client tests run: what it does is chosen by the payload.

``{"fail": "why"}`` fails the task (not retried); ``{"seconds": s}`` takes up to ``s``
seconds, returning early once cancelled (``{"stopped": true}``); anything else is echoed
with the task's message id.
"""

from __future__ import annotations

from typing import Any

from broker_adapter.handler.task import Task


def by_payload(task: Task) -> dict[str, Any]:
    if "fail" in task.payload:
        raise ValueError(str(task.payload["fail"]))
    if "seconds" in task.payload:
        return {"stopped": task.wait_cancelled(float(task.payload["seconds"]))}
    return {"echo": task.payload, "message_id": task.message_id}
