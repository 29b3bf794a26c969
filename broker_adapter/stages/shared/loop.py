"""The stage loop (``run_stage``), and how a polling stage waits when idle (``IdlePolicy``).

A shared stage helper, not a stage. All five stages run ``run_stage``: the worker
(``worker.Worker.run``), the dispatcher (``dispatcher.Dispatcher.run``), the ingest and the
receiver (``Ingestor.run``, ``Receiver.run``: ``consumer.GroupConsumer`` steps) and the
reconcile (``reconciler.run_reconciles``). It holds the rules they share, once:

* a step until ``stop``; a ``TransientError`` backs off with ``backoff.retrying`` (logged
  once per backoff; a stop ends the backoff at once and the loop returns);
* after a step that found nothing, the stage's own wait (an ``IdlePolicy``, a hand-off, a
  fixed interval; none for a stage whose reads block);
* once stopped, the stage's drain of the work it already took (tasks or rows claimed ahead,
  entries read ahead); a transient failure there ends the drain, the work left comes back
  (leases run out, entries stay pending);
* any other ``BrokerAdapterError`` propagates: the stage stops loudly.

The idle policy is how often a polling loop (the worker, the dispatcher) looks for work
when there is none. After its last work it looks again every ``first_s`` for
``ALERT_AFTER_WORK_S``, then the pause doubles with every empty look, up to ``longest_s``.
A look is a read (``look``: no write lock, no fsync); a step follows only when it finds
something. The pauses themselves are waits on the loop's stop event (or on a hand-off:
``IdleWait``, the worker's end of the ingest's hand-off), which the loop gives
``IdlePolicy.wait_for_work``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final, Literal, Protocol

import tenacity

from broker_adapter.backoff import retrying
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


def run_stage(
    stop: threading.Event,
    step: Callable[[], object],
    *,
    log: logging.Logger,
    what: str,
    wait: Callable[[], object] | None = None,
    pending: Callable[[], bool] | None = None,
    drain: Callable[[], object] | None = None,
    on_backoff: Callable[[BaseException | None], None] | None = None,
    sleep: Callable[[float], object] | None = None,
) -> None:
    """A stage's loop: ``step`` until ``stop`` is set, then the drain.

    The backoff policy wraps a run of steps, not each step: its bookkeeping costs as much
    as the work of a one-entry batch. A run ends at the first step that succeeds after a
    backoff, so that the backoff grows over consecutive failures only.

    Args:
        stop: set it to stop (after the step or wait in progress; a backoff ends at once).
        step: one step of the stage; truthy: it did work (step again at once), falsy: it
            found nothing (``wait`` first).
        log: where the backoffs and the drain's failure are reported.
        what: the stage, as the log lines name it.
        wait: the stage's wait after a step that found nothing (it returns early when
            ``stop`` is set); ``None``: step again at once (the step's reads block).
        pending: once stopped, whether work already taken waits (claimed or read ahead);
            ``None``: never.
        drain: how that work is done once stopped (``step`` by default), called while
            ``pending()``; a ``TransientError`` ends the drain (logged): the work left
            comes back by itself (leases run out, entries stay pending).
        on_backoff: called with the failure before each backoff (e.g. to count it).
        sleep: how a backoff waits (``stop.wait``: a stop ends it at once).

    Raises:
        BrokerAdapterError: a failure that is not transient (the stage stops loudly).
    """
    backed_off = False

    def announce(state: tenacity.RetryCallState) -> None:
        nonlocal backed_off
        backed_off = True
        exc = state.outcome.exception() if state.outcome else None
        if on_backoff is not None:
            on_backoff(exc)
        log.warning(
            "%s: transient failure (attempt %d), backing off: %s",
            what,
            state.attempt_number,
            exc,
        )

    policy = retrying().copy(
        stop=tenacity.stop_when_event_set(stop),
        sleep=sleep or stop.wait,
        before_sleep=announce,
    )

    def steps() -> None:
        nonlocal backed_off
        while not stop.is_set():
            if not step() and wait is not None and not stop.is_set():
                wait()
            if backed_off:  # recovered: a fresh policy call starts the backoff over
                backed_off = False
                return

    while not stop.is_set():
        try:
            policy(steps)
        except TransientError as exc:
            if not stop.is_set():  # pragma: no cover - the policy never gives up
                raise
            log.info("%s: stopping during a backoff (%s)", what, exc)
    finish = drain or step
    while pending is not None and pending():
        try:
            finish()
        except TransientError as exc:
            log.warning("%s: stopping; the work taken ahead is left to come back: %s", what, exc)
            return
