"""How stage loops wait: the idle policy of a polling loop, and the loop of a periodic pass.

A shared stage helper, not a stage. The worker (``worker.Worker.run``) and the dispatcher
(``dispatcher.Dispatcher.run``) follow the idle policy: how often to look for work when
there is none. After its last work a loop looks again every ``first_s`` for
``ALERT_AFTER_WORK_S``, then the pause doubles with every empty look, up to ``longest_s``.
A look is a read (``look``: no write lock, no fsync); a step follows only when it finds
something. The pauses themselves are waits on the loop's stop event (or on a hand-off:
``IdleWait``, the worker's end of the ingest's hand-off), which the loop gives
``IdlePolicy.wait_for_work``.

The reconcile (``effects.run_reconciles``) is a periodic pass (``run_passes``). The ingest
and the receiver consume a stream (``consumer.run_consumers``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final, Literal, Protocol

from broker_adapter.errors import TransientError

#: A polling loop's default longest pause between two looks when idle (``idle_poll_s``), and
#: its pause between looks for ``ALERT_AFTER_WORK_S`` after its last work (``wake_poll_s``),
#: seconds: the worker's and the dispatcher's defaults.
DEFAULT_IDLE_POLL_S = 0.05
DEFAULT_WAKE_POLL_S = 0.001

#: An idle loop keeps looking every ``first_s`` this long after its last work, then backs
#: off towards ``longest_s``.
ALERT_AFTER_WORK_S = 1.0

#: Hand-off message: the claim for this worker found nothing; look (a read) before claiming.
LOOK: Final = "look"
#: Hand-off message: tasks were stored that no worker was handed; claim them.
CLAIM: Final = "claim"

#: A task handed over already claimed: ``(task_id, fence)``.
Handle = tuple[str, int]
#: What a wait returns: handles, ``LOOK``, ``CLAIM``, or ``None`` (nothing came in time).
Handed = list[Handle] | Literal["look", "claim"] | None


class IdleWait(Protocol):
    """What a worker waits on when idle instead of a plain pause (its end of the ingest's
    hand-off, ``handoff.HandoffEndpoint``; tests script their own)."""

    def wait(self, timeout_s: float, want: int) -> Handed: ...

    def offer(self, want: int) -> None: ...

    def withdraw(self) -> Handed: ...


class IdlePolicy:
    """The pause before a loop's next look for work.

    Args:
        first_s: the pause right after work (and for ``ALERT_AFTER_WORK_S`` after it).
        longest_s: the longest pause, reached by doubling.
    """

    def __init__(self, first_s: float, longest_s: float) -> None:
        self.first_s = first_s
        self.longest_s = longest_s
        #: The pause before the next look, seconds.
        self.pause_s = first_s
        #: ``time.monotonic()`` of the last work.
        self.busy_at = time.monotonic()

    def worked(self) -> None:
        """The loop did work: look again soon."""
        self.busy_at = time.monotonic()
        self.pause_s = self.first_s

    def waited(self) -> None:
        """One pause passed with nothing found: the next one doubles, once the last work is
        ``ALERT_AFTER_WORK_S`` old."""
        if time.monotonic() - self.busy_at >= ALERT_AFTER_WORK_S:
            self.pause_s = min(self.pause_s * 2, self.longest_s)

    def wait_for_work(
        self,
        wait: Callable[[float], bool],
        found: Callable[[], bool],
        *,
        handed: Callable[[], bool] | None = None,
    ) -> None:
        """Pause until there is work or the loop is to stop.

        Args:
            wait: one pause of the given length; ``True`` when the loop is to stop.
            found: after each pause (once it has grown): whether there is work now (a look).
            handed: after each pause, first: whether work came with it (a hand-off); then
                the pause does not grow.
        """
        while not wait(self.pause_s):
            if handed is not None and handed():
                return
            self.waited()
            if found():
                return


def look(probe: Callable[[], bool], log: logging.Logger, what: str) -> bool:
    """Run one look for work (``probe``, a read); a transient failure is logged as ``what``
    failing and counts as nothing found (the next look tries again)."""
    try:
        return probe()
    except TransientError as exc:
        log.warning("%s failed, will retry: %s", what, exc)
        return False


def run_passes(
    stop: threading.Event,
    one_pass: Callable[[], bool],
    every_s: float,
    log: logging.Logger,
    what: str,
) -> None:
    """Run ``one_pass`` every ``every_s`` until ``stop`` is set, at once again while it
    returns ``True`` (more is waiting). A transient failure is logged as ``what`` failing
    and the pass is tried again at the next interval."""
    while not stop.is_set():
        more = False
        try:
            more = one_pass()
        except TransientError as exc:
            log.warning("%s failed, will retry: %s", what, exc)
        if not more and stop.wait(every_s):
            return
