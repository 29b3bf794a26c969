"""An example handler for a first ``broker-adapter run --handler broker_adapter.examples:echo``
(docs/CLI.md, docker-compose.yml).

A handler takes one ``Task`` and returns a JSON value (the reply's ``result``). Raise
``RetryableError`` for a failure worth retrying; any other exception fails the task.
"""

from __future__ import annotations

from typing import Any

from broker_adapter.handler.task import Task


def echo(task: Task) -> dict[str, Any]:
    """Return the payload, with the task's identity."""
    return {"echo": task.payload, "message_id": task.message_id, "attempt": task.attempt}
