"""Run a router's tasks in process, for an application's unit tests: the worker's own code
(routing and payload validation, the call, result bounds, retries with their backoff, effect
declarations, the reply) on a SQLite store in a temporary directory and a ``FakeClock``. No
Redis: a request goes straight into the store, and its reply is read from the outbox.

    runner = TaskRunner(router)
    reply = runner.run("restart", {"service": "web"})
    assert reply.status == "done"

A retry's backoff passes on the fake clock (``clock.advance``), never in real time.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from broker_adapter.clock import FakeClock
from broker_adapter.errors import ConfigError
from broker_adapter.handler.router import Router
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.reply import Reply
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.stages.worker.worker import Worker
from broker_adapter.store import AcceptItem, OutboxStore, TaskStore, open_database
from broker_adapter.store.task_types import TERMINAL_STATES

#: How many rounds of the worker ``run`` allows one request (each: one claim, or one wait
#: on the fake clock for a retry's backoff).
MAX_ROUNDS = 100


class TaskRunner:
    """A worker of ``router`` on a store of its own.

    Args:
        router: the tasks, as ``broker-adapter run --app`` would serve them.
        principal: who the requests come from.
        clock: the time source (a ``FakeClock`` starting now by default); the runner
            advances it over a retry's backoff.
        call_timeout_s: the worker's call timeout.
    """

    def __init__(
        self,
        router: Router,
        *,
        principal: str = "test-agent",
        clock: FakeClock | None = None,
        call_timeout_s: float = 30.0,
    ) -> None:
        self.router = router
        self.principal = principal
        self.clock = clock or FakeClock()
        self._dir = Path(tempfile.mkdtemp(prefix="ba-task-runner-"))
        self.db = open_database(self._dir / "tasks.db")
        self.tasks = TaskStore(self.db, self.clock)
        self.outbox = OutboxStore(self.db, self.clock)
        config = WorkerConfig(owner="test-worker", call_timeout_s=call_timeout_s)
        self.worker = Worker(config, self.tasks, router, clock=self.clock)

    def run(
        self,
        task: str | None,
        payload: dict[str, Any],
        *,
        message_id: str | None = None,
        max_attempts: int = 3,
        deadline_in_s: float = 3600.0,
    ) -> Reply:
        """Accept one request, run it to its end (every attempt it gets), return its reply.

        Raises:
            ConfigError: the request was refused by the store (its reason), or it did not
                end within ``MAX_ROUNDS`` rounds.
        """
        envelope = Envelope.build(
            message_id=message_id or f"test-{uuid.uuid4().hex}",
            sender=self.principal,
            payload=payload,
            task=task,
            deadline=self.clock.now() + deadline_in_s,
            max_attempts=max_attempts,
        )
        (accepted,) = self.tasks.accept([AcceptItem(self.principal, envelope)])
        if accepted.task_id is None:
            raise ConfigError(f"the store refused the request: {accepted}")
        task_id = accepted.task_id
        for _ in range(MAX_ROUNDS):
            row = self.tasks.get(task_id)
            if row is None:
                raise ConfigError(f"task {task_id} is gone")
            if row.state in TERMINAL_STATES:
                return self.reply(task_id)
            if row.state == "pending" and row.not_before > self.clock.now():
                self.clock.advance(row.not_before - self.clock.now())  # the retry's backoff
            self.worker.run_once()
        raise ConfigError(f"task {task_id} did not end in {MAX_ROUNDS} rounds")

    def reply(self, task_id: str) -> Reply:
        """The reply the worker wrote for ``task_id``."""
        rows = [r for r in self.outbox.list() if r.task_id == task_id]
        if len(rows) != 1:
            raise ConfigError(f"task {task_id} has {len(rows)} replies, not one")
        return Reply.from_mapping(json.loads(rows[0].body))

    def close(self) -> None:
        """Close the store and remove its directory."""
        self.db.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> TaskRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
