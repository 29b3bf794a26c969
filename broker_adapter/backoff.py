"""Backing off: capped exponential backoff with jitter, shared by task retries and reply
publication (``Backoff``), and the retry policy of the loops that talk to Redis or SQLite
(``retrying``: the stage loop's, ``stages.shared.loop.run_stage``, and a stage's set-up's,
``call_until_stopped``).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from typing import TypeVar

import tenacity

from broker_adapter.config import ConfigModel, setting
from broker_adapter.errors import TransientError

log = logging.getLogger("broker_adapter.backoff")
T = TypeVar("T")

#: A retried task's backoff (``Backoff``'s defaults are the tasks').
BACKOFF_BASE_SETTING = setting(
    1.0,
    ge=0,
    help="a retried task's first backoff, seconds (doubling per attempt, half of it random)",
    flag="--backoff-base",
    env="BA_BACKOFF_BASE_S",
    metavar="S",
)
BACKOFF_CAP_SETTING = setting(
    60.0,
    ge=0,
    help="the longest backoff, seconds (a RetryableError's retry_after_s may ask for longer)",
    flag="--backoff-cap",
    env="BA_BACKOFF_CAP_S",
    metavar="S",
)


class Backoff(ConfigModel):
    """``delay(n)`` for the n-th retry (n >= 1): half of ``min(cap, base * 2**(n-1))`` fixed,
    the other half random ("equal jitter"), so retries spread out but never collapse to 0.

    Attributes:
        base_s: the first retry's upper bound, seconds.
        cap_s: no retry waits longer than this, seconds.

    Raises:
        ConfigError: a negative ``base_s`` or ``cap_s``.
    """

    base_s: float = BACKOFF_BASE_SETTING
    cap_s: float = BACKOFF_CAP_SETTING

    def ceiling(self, n: int) -> float:
        """The largest delay the n-th retry can get."""
        exponent = min(max(n - 1, 0), 62)
        return float(min(self.cap_s, self.base_s * (2**exponent)))

    def delay(self, n: int, rng: random.Random | None = None) -> float:
        top = self.ceiling(n)
        r = (rng or random).random()
        return top / 2 + r * top / 2


def retrying(*, max_wait_s: float = 5.0, multiplier_s: float = 0.05) -> tenacity.Retrying:
    """A tenacity policy for loops that talk to Redis or SQLite: retry ``TransientError``
    forever with capped exponential backoff and full jitter."""
    return tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(TransientError),
        wait=tenacity.wait_random_exponential(multiplier=multiplier_s, max=max_wait_s),
        reraise=True,
        before_sleep=lambda state: log.warning(
            "transient failure (attempt %d), backing off: %s",
            state.attempt_number,
            state.outcome.exception() if state.outcome else "?",
        ),
    )


def call_until_stopped(
    stop: threading.Event,
    call: Callable[[], T],
    *,
    sleep: Callable[[float], object] | None = None,
) -> T | None:
    """``call()``, retried on ``TransientError`` with the ``retrying`` policy until it
    returns or ``stop`` is set: a stage's set-up that needs a server which may be down
    for a moment (a Redis Cluster client reads the slot map when it is made).

    Args:
        stop: set it to give up (a backoff in progress ends at once).
        call: what to do; its result is returned.
        sleep: how a backoff waits (``stop.wait``).

    Returns:
        What ``call`` returned, or ``None`` when ``stop`` was set before it succeeded.

    Raises:
        BrokerAdapterError: a failure that is not transient.
    """
    policy = retrying().copy(stop=tenacity.stop_when_event_set(stop), sleep=sleep or stop.wait)
    try:
        return policy(call)
    except TransientError:
        if stop.is_set():
            return None
        raise  # pragma: no cover - the policy gives up only when stopped
