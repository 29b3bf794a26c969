"""Clocks for tests beyond ``broker_adapter.clock.FakeClock``."""

from __future__ import annotations

import time

from broker_adapter.clock import SystemClock


class SkewedClock(SystemClock):
    """The host's clock off by ``offset_s`` seconds (ahead when positive): a host whose
    clock is wrong. Still the host's clock: on PostgreSQL a store judges by the server's
    instead (``store.dbclock``)."""

    def __init__(self, offset_s: float) -> None:
        self.offset_s = offset_s

    def now(self) -> float:
        return time.time() + self.offset_s
