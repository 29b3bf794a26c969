"""A worker's idle wait driven by a test's script instead of the ingest's hand-off pipe."""

from __future__ import annotations

from collections.abc import Callable

from broker_adapter.stages.shared.loop import Handed


class ScriptedWait:
    """``IdleWait`` whose waits return what ``step(timeout_s)`` says; ``wants`` records the
    task count the worker asked for at each wait, ``offers`` at each offer before a
    finishing commit, whose ``withdraw`` returns what ``withdraw()`` says (else nothing)."""

    def __init__(
        self, step: Callable[[float], Handed], withdraw: Callable[[], Handed] | None = None
    ) -> None:
        self._step = step
        self._withdraw = withdraw
        self.wants: list[int] = []
        self.offers: list[int] = []

    def wait(self, timeout_s: float, want: int) -> Handed:
        self.wants.append(want)
        return self._step(timeout_s)

    def offer(self, want: int) -> None:
        self.offers.append(want)

    def withdraw(self) -> Handed:
        return None if self._withdraw is None else self._withdraw()
