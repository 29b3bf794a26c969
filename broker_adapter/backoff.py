"""Capped exponential backoff with jitter, shared by task retries and reply publication."""

from __future__ import annotations

import random

from pydantic import Field

from broker_adapter.config import ConfigModel


class Backoff(ConfigModel):
    """``delay(n)`` for the n-th retry (n >= 1): half of ``min(cap, base * 2**(n-1))`` fixed,
    the other half random ("equal jitter"), so retries spread out but never collapse to 0.

    Attributes:
        base_s: the first retry's upper bound, seconds.
        cap_s: no retry waits longer than this, seconds.

    Raises:
        ConfigError: a negative ``base_s`` or ``cap_s``.
    """

    base_s: float = Field(default=1.0, ge=0)
    cap_s: float = Field(default=60.0, ge=0)

    def ceiling(self, n: int) -> float:
        """The largest delay the n-th retry can get."""
        exponent = min(max(n - 1, 0), 62)
        return float(min(self.cap_s, self.base_s * (2**exponent)))

    def delay(self, n: int, rng: random.Random | None = None) -> float:
        top = self.ceiling(n)
        r = (rng or random).random()
        return top / 2 + r * top / 2
