"""Time as a dependency: every component asks a ``Clock`` for the time, so tests never sleep."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Wall-clock seconds since the epoch (float)."""

    def now(self) -> float: ...


class SystemClock:
    """The real clock (``time.time``): the host's. On a database shared by hosts
    (PostgreSQL) the stores judge leases by the server's clock instead (``store.dbclock``);
    a ``FakeClock`` is a test's time on every engine."""

    def now(self) -> float:
        return time.time()


class FakeClock:
    """A clock that moves only when told to. Thread-safe."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        """Move the clock forward by ``seconds`` and return the new time."""
        if seconds < 0:
            raise ValueError("a FakeClock only moves forward")
        with self._lock:
            self._now += seconds
            return self._now

    def set(self, when: float) -> None:
        with self._lock:
            self._now = when
