"""A worker's side of a ``Router``: route each claimed task to its handler before it starts.

Before the start (``Routes.route``, on the call thread, after the start checks of
``task_start`` and before an effect's gate): the task's name is looked up and its payload
validated against the task's model; the validated model is what the handler reads as
``Task.args``. A task that cannot be routed (unknown name, invalid payload) still goes
through one call, ``Routes.call``, which raises its ``RouteError`` at once: no handler runs,
and the task ends ``failed`` (never retried) with the error in its reply.

``Routes.call`` is the handler the worker's ``CallRun`` calls: it waits for a permit of the
task's concurrency limit (``TaskLimits``: per worker; the wait counts against the call
timeout), calls the handler, sends a returned pydantic model
as its JSON form, and holds the permit until the call (an async one: its coroutine) ends.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from pydantic import BaseModel

from broker_adapter.errors import RetryableError
from broker_adapter.handler.effects import EffectSpec, effect_spec
from broker_adapter.handler.router import RouteError, Router, TaskDef
from broker_adapter.handler.task import Task, TaskControl
from broker_adapter.stages.worker.effect_gate import EffectGate
from broker_adapter.store.settle import Settlement
from broker_adapter.store.task_types import ClaimedTask

#: How often a call waiting for its task's concurrency permit looks whether it was stopped.
PERMIT_POLL_S = 0.05


class TaskLimits:
    """The concurrency limit of each task name that has one, for one worker process.

    Args:
        router: the tasks (``TaskDef.concurrency``).
    """

    def __init__(self, router: Router) -> None:
        self._permits = {
            spec.name: threading.BoundedSemaphore(spec.concurrency)
            for spec in router
            if spec.concurrency is not None
        }

    def permit(self, name: str | None) -> threading.BoundedSemaphore | None:
        return self._permits.get(name)


class Routes:
    """Routing, effect gates and per-task settings of one worker.

    Args:
        router: the tasks served.
        gate_of: builds the effect gate of a handler's declared effect.
        limits: the concurrency limits (``None``: new ones, this worker's own).
    """

    def __init__(
        self,
        router: Router,
        gate_of: Callable[[EffectSpec], EffectGate],
        limits: TaskLimits | None = None,
    ) -> None:
        self.router = router
        self.limits = limits or TaskLimits(router)
        self._gates: dict[str | None, EffectGate] = {}
        for spec in router:
            declared = effect_spec(spec.handler)
            if declared is not None:
                self._gates[spec.name] = gate_of(declared)
        #: What ``route`` decided per claimed task, until its call takes it.
        self._routed: dict[str, TaskDef | RouteError] = {}

    def route(self, task: Task) -> TaskDef | None:
        """Resolve ``task`` (its ``args`` set); ``None`` when it cannot be routed (its call
        will raise why)."""
        try:
            spec, args = self.router.resolve(task.task_name, task.payload)
        except RouteError as exc:
            self._routed[task.task_id] = exc
            return None
        TaskControl(task).set_args(args)
        self._routed[task.task_id] = spec
        return spec

    def forget(self, task: Task) -> None:
        """Drop what ``route`` decided for ``task``: it is not to run after all."""
        self._routed.pop(task.task_id, None)

    def gate(self, task: Task) -> EffectGate | None:
        """The effect gate of ``task``'s handler, or ``None`` (none declared, or unrouted)."""
        return self.gate_named(task.task_name) if self._gates else None

    def gate_named(self, name: str | None) -> EffectGate | None:
        """The effect gate of the handler an envelope naming ``name`` goes to, or ``None``."""
        spec = self.router.get(name)
        return None if spec is None else self._gates.get(spec.name)

    def cap_attempts(self, claimed: ClaimedTask, item: Settlement) -> Settlement:
        """``item`` without its retry once the task used the attempts its ``TaskDef``
        allows."""
        if not item.retryable:
            return item
        spec = self.router.get(claimed.task_name)
        if spec is None or spec.max_attempts is None or claimed.attempt < spec.max_attempts:
            return item
        error = f"{item.error} (attempts exhausted: task {spec.name!r} allows {spec.max_attempts})"
        return replace(item, error=error, retryable=False, retry_after_s=None)

    def call(self, task: Task) -> Any:
        """Run ``task``'s handler (the worker's ``Handler``); see the module."""
        routed = self._routed.pop(task.task_id, None)
        if routed is None:  # called without ``route`` first
            self.route(task)
            routed = self._routed.pop(task.task_id)
        if isinstance(routed, RouteError):
            raise routed
        permit = self.limits.permit(routed.name)
        if permit is not None:
            while not permit.acquire(timeout=PERMIT_POLL_S):
                if task.wait_cancelled(0):
                    raise RetryableError("stopped while waiting for a concurrency permit")
        try:
            value = routed.handler(task)
        except BaseException:
            if permit is not None:
                permit.release()
            raise
        if inspect.isawaitable(value):
            return _finished(value, permit)
        if permit is not None:
            permit.release()
        return _as_json(value)


async def _finished(call: Awaitable[Any], permit: threading.BoundedSemaphore | None) -> Any:
    try:
        return _as_json(await call)
    finally:
        if permit is not None:
            permit.release()


def _as_json(value: Any) -> Any:
    """A returned pydantic model as its JSON form; anything else as it is."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return value
