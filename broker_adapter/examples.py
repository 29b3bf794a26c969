"""Example handlers, used by the demo and handy for a first ``broker-adapter run``.

A handler takes one ``Task`` and returns a JSON value (the reply's ``result``). Raise
``RetryableError`` for a failure worth retrying; any other exception fails the task.
"""

from __future__ import annotations

from typing import Any

from broker_adapter.stages.handlers import Task


def echo(task: Task) -> dict[str, Any]:
    """Return the payload, with the task's identity."""
    return {"echo": task.payload, "message_id": task.message_id, "attempt": task.attempt}


def upper(task: Task) -> dict[str, Any]:
    """Upper-case ``payload["text"]``; fails (not retried) when it is missing."""
    text = task.payload.get("text")
    if not isinstance(text, str):
        raise ValueError("payload needs a string 'text'")
    return {"text": text.upper()}
