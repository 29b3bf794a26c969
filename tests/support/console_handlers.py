"""The handler of the console's browser tests (``tests/integration/test_console_browser.py``),
loadable as ``tests.support.console_handlers:handler``.

Declared ``side_effect(..., irreversible=False)`` with no reconcile function, so an answer
lost after the effect started waits for an operator. By payload:

* ``"hold": true``: runs until its task's cancel is seen (the task stays open: its
  principal's quota is full), then raises.
* ``"lose_answer": true``: says its effect started, then asks for a retry: the outcome is
  unknown and only an operator can say what happened.
* otherwise: ``handlers.record_effect`` (its ledger, in the payload's ``effects_db``,
  counts the runs).
"""

from __future__ import annotations

from typing import Any

from broker_adapter.errors import RetryableError
from broker_adapter.handler.effects import side_effect
from broker_adapter.handler.task import Task
from tests.support.handlers import record_effect


@side_effect("console-test", irreversible=False)
def handler(task: Task) -> dict[str, Any]:
    if task.payload.get("hold"):
        while not task.cancelled():  # asks the store: a requested cancel is seen here
            task.wait_cancelled(0.05)
        raise RuntimeError("stopped on its cancel")
    if task.payload.get("lose_answer"):
        task.effect_started()
        raise RetryableError("the answer was lost after the effect started")
    return record_effect(task)
