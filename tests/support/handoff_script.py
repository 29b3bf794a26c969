"""A worker's idle wait driven by a test's script instead of the ingest's hand-off pipe."""

from __future__ import annotations

from collections.abc import Callable

from broker_adapter.handoff import Handed


class ScriptedWait:
    """``IdleWait`` whose waits return what ``step(timeout_s)`` says; ``wants`` records the
    task count the worker asked for at each wait."""

    def __init__(self, step: Callable[[float], Handed]) -> None:
        self._step = step
        self.wants: list[int] = []

    def wait(self, timeout_s: float, want: int) -> Handed:
        self.wants.append(want)
        return self._step(timeout_s)
