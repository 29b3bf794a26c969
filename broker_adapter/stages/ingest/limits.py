"""Ingress limits per principal: a token bucket on entries and a quota of open tasks.

Both are charged to the *authenticated* principal, after the signature (signed mode) or
the stream (ACL mode) proved who sent an entry: counting an entry before that would let
anybody spend another principal's allowance with forged entries.

* **Rate** (``rate_limit`` entries per second, bursts of ``rate_burst``): every
  authenticated entry takes one token (new request, conflict, not a task), except one whose
  message id the inbox holds already for its principal (``known``: one lookup per batch):
  anybody who can write the stream can add a captured entry again, and such copies must
  not spend its principal's budget (they cost the inbox a duplicate answer, no task);
  tokens come back at ``rate_limit`` per second up to
  ``rate_burst``. The bucket is in memory: a restarted ingest starts every principal
  with a full bucket.
* **Open tasks** (``max_open_tasks``): a principal with that many tasks not yet terminal
  (pending or running) gets no new one. The counts come from the store once per batch
  (``TaskStore.open_counts``, one query over the live tasks' index) and go up by one for
  each entry admitted in the batch, duplicates included: within a batch the count errs
  towards refusing, and the next batch reads the truth again. Two ingests on one
  database each check against their own reading, so together they may admit up to one
  batch more than the quota.

An entry over a limit is refused with ``rate_limited`` or ``quota_exceeded`` (quota first:
a refusal for the quota spends no token). The ingest dead-letters it with that reason
(acknowledged, nothing stored, no reply) and counts it in its stats; the sender, who sees
no reply, resends later under the same message id, as for any lost request.

Time comes from the injected ``Clock`` (a ``FakeClock`` in tests). A clock that steps back
refills nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from broker_adapter.clock import Clock

RATE_LIMITED = "rate_limited"
QUOTA_EXCEEDED = "quota_exceeded"


class Refusal(NamedTuple):
    """Why one entry is not admitted: the dead-letter reason and its detail."""

    reason: str
    detail: str


def default_burst(rate_limit: float) -> int:
    """The burst when none is configured: one second's worth of tokens, at least one."""
    return max(1, math.ceil(rate_limit))


@dataclass
class _Bucket:
    tokens: float
    at: float


class IngressLimits:
    """Decides, entry by entry, whether a principal may hand in one more request.

    Args:
        clock: the time source for refills.
        rate_limit: tokens per second per principal; ``None`` for no rate limit.
        rate_burst: the bucket's size; ``None`` for ``default_burst(rate_limit)``.
        max_open_tasks: open tasks allowed per principal; ``None`` for no quota.
        open_counts: the store's count of open tasks per principal (only principals
            with at least one need be listed); called at most once per batch, and only
            with a quota.
        stored: which of a principal's message ids the inbox holds (``known``).
    """

    def __init__(
        self,
        clock: Clock,
        *,
        rate_limit: float | None = None,
        rate_burst: int | None = None,
        max_open_tasks: int | None = None,
        open_counts: Callable[[], Mapping[str, int]] | None = None,
        stored: Callable[[str, Sequence[str]], set[str]] | None = None,
    ) -> None:
        if rate_limit is not None and not rate_limit > 0:
            raise ValueError("rate_limit must be above 0")
        if max_open_tasks is not None and open_counts is None:
            raise ValueError("max_open_tasks needs open_counts")
        self.clock = clock
        self.rate_limit = rate_limit
        self.burst = (
            rate_burst
            if rate_burst is not None or rate_limit is None
            else default_burst(rate_limit)
        )
        self.max_open_tasks = max_open_tasks
        self._open_counts = open_counts
        self._stored = stored
        self._buckets: dict[str, _Bucket] = {}
        self._open: dict[str, int] | None = None

    @property
    def enabled(self) -> bool:
        return self.rate_limit is not None or self.max_open_tasks is not None

    def known(self, ids: Sequence[tuple[str, str]]) -> set[tuple[str, str]]:
        """Which ``(principal, message_id)`` pairs of a batch the inbox holds already:
        ``admit`` is not called for them (they spend no token and no quota). Empty when no
        limit is on or no ``stored`` lookup was given."""
        if not self.enabled or self._stored is None or not ids:
            return set()
        by_principal: dict[str, list[str]] = {}
        for principal, message_id in ids:
            by_principal.setdefault(principal, []).append(message_id)
        return {
            (principal, m)
            for principal, message_ids in by_principal.items()
            for m in self._stored(principal, message_ids)
        }

    def new_batch(self) -> None:
        """Forget the open-task counts: the next ``admit`` reads them from the store."""
        self._open = None

    def admit(self, principal: str) -> Refusal | None:
        """Charge one entry to ``principal``.

        Returns:
            ``None`` when admitted (a token taken, the open count raised), else why not
            (and nothing was charged).
        """
        if self.max_open_tasks is not None:
            if self._open is None:
                assert self._open_counts is not None  # checked in __init__
                self._open = dict(self._open_counts())
            open_now = self._open.get(principal, 0)
            if open_now >= self.max_open_tasks:
                return Refusal(
                    QUOTA_EXCEEDED,
                    f"principal {principal!r} has {open_now} open tasks, "
                    f"limit {self.max_open_tasks}",
                )
        if self.rate_limit is not None and not self._take(principal, self.rate_limit):
            return Refusal(
                RATE_LIMITED,
                f"principal {principal!r} is over {self.rate_limit:g} entries/s "
                f"(burst {self.burst})",
            )
        if self._open is not None:
            self._open[principal] = self._open.get(principal, 0) + 1
        return None

    def _take(self, principal: str, rate: float) -> bool:
        now = self.clock.now()
        capacity = float(self.burst or 1)
        bucket = self._buckets.get(principal)
        if bucket is None:
            bucket = self._buckets[principal] = _Bucket(capacity, now)
        elif now > bucket.at:
            bucket.tokens = min(capacity, bucket.tokens + (now - bucket.at) * rate)
            bucket.at = now
        if bucket.tokens < 1.0 - 1e-9:  # refills in float steps may land a hair below 1
            return False
        bucket.tokens -= 1.0
        return True
