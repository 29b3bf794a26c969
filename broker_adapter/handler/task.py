"""The ``Task`` a handler receives: the claimed task's fields and its cancellation check.

``Task`` holds only what a handler reads and asks (``cancelled()``, ``wait_cancelled()``,
``time_left_s()``, ``effect_key()``, and ``effect_started()`` for a handler declared with
``effects.side_effect(..., irreversible=False)``). What the worker writes on it (a cancel
seen at a lease renewal, a lost lease, an abandoned call, a renewed lease) goes through
``TaskControl``, the worker's side of the same task (``stages.worker.lease``,
``stages.shared.calls``), so a handler has no public method that changes its own task's
state."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Literal

from broker_adapter.clock import Clock, SystemClock
from broker_adapter.errors import ConfigError, StaleError
from broker_adapter.protocol.idempotency import EFFECT_KEY_VERSION, Intent, action_key
from broker_adapter.store.task_types import ClaimedTask

#: Why a task's ``cancelled()`` turned True.
StopReason = Literal["cancelled", "lease_lost", "timeout", "stopping"]


class Task:
    """What a handler receives: the claimed task, plus a cancellation check.

    ``cancelled()`` turns True once the task was cancelled (seen in the store, or refused at a
    lease renewal), the lease was lost, the call timed out, or the worker stopped past its
    grace. After that the worker commits nothing the handler returns: stop early.

    Args:
        claimed: the claim as the store returned it.
        clock: the time source used for ``time_left_s``.
        cancel_check: asks the store whether the task is still to run: ``False`` (yes),
            ``True`` (it was cancelled) or the ``StaleError`` that says the claim is lost
            (``None``: never asks).
    """

    def __init__(
        self,
        claimed: ClaimedTask,
        *,
        clock: Clock | None = None,
        cancel_check: Callable[[], bool | StaleError] | None = None,
    ) -> None:
        self.claimed = claimed
        self._clock = clock or SystemClock()
        self._cancel_check = cancel_check
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._reason: StopReason | None = None
        self._lease_lost: StaleError | None = None
        self._lease_until = claimed.lease_until
        #: Records this attempt's effect as started (set by the worker for a declared
        #: effect: ``effects.side_effect``); ``None``: the handler declared none.
        self._start_effect: Callable[[], None] | None = None
        self._effect_started = False
        self._args: Any = None

    # -- what the handler reads -----------------------------------------------------------

    @property
    def task_id(self) -> str:
        return self.claimed.task_id

    @property
    def principal(self) -> str:
        return self.claimed.principal

    @property
    def message_id(self) -> str:
        return self.claimed.message_id

    @property
    def kind(self) -> str:
        return self.claimed.kind

    @property
    def payload(self) -> dict[str, Any]:
        return self.claimed.payload

    @property
    def task_name(self) -> str | None:
        """The task name the request asked for (``Envelope.task``); ``None``: the default."""
        return self.claimed.task_name

    @property
    def args(self) -> Any:
        """The payload validated against the task's model (``Router.task(payload=...)``):
        an instance of it; ``None`` for a task registered without one."""
        return self._args

    @property
    def attempt(self) -> int:
        """1 for the first attempt; counted at claim time, so a crashed attempt counts."""
        return self.claimed.attempt

    @property
    def max_attempts(self) -> int:
        return self.claimed.max_attempts

    @property
    def fence(self) -> int:
        """This claim's fencing token; pass it with the idempotency key to external systems."""
        return self.claimed.fence

    @property
    def owner(self) -> str:
        return self.claimed.owner

    @property
    def deadline(self) -> float:
        """Absolute deadline, epoch seconds. Retries never move it."""
        return self.claimed.deadline

    @property
    def hops(self) -> int:
        return self.claimed.hops

    @property
    def correlation_id(self) -> str | None:
        return self.claimed.correlation_id

    @property
    def parent_id(self) -> str | None:
        return self.claimed.parent_id

    @property
    def traceparent(self) -> str | None:
        """The W3C trace context the request was sent with, if any."""
        return self.claimed.traceparent

    @property
    def idempotency_key(self) -> str:
        """Stable across attempts, fences and every task of the same request (it is derived
        from the principal and message id: ``protocol.idempotency.idempotency_key_for``):
        key every external effect by it."""
        return self.claimed.idempotency_key

    @property
    def lease_until(self) -> float:
        """When the current lease ends (epoch seconds); moves forward at each renewal."""
        with self._lock:
            return self._lease_until

    @property
    def lease_lost(self) -> StaleError | None:
        """The refusal that ended the lease, or ``None`` while it is held."""
        with self._lock:
            return self._lease_lost

    @property
    def stop_reason(self) -> StopReason | None:
        """Why ``cancelled()`` is True, or ``None`` while it is False."""
        with self._lock:
            return self._reason

    def effect_key(
        self, action: str, arguments: Any = None, *, version: int = EFFECT_KEY_VERSION
    ) -> str:
        """The idempotency key of one external effect of this request: derived from the
        intent (principal, message id), ``action`` and ``arguments`` (default: the
        payload), never from the attempt, the time or randomness
        (``protocol.idempotency.action_key``); the same in every attempt. Send it to the
        target, e.g. as an ``Idempotency-Key`` header."""
        args = self.payload if arguments is None else arguments
        return action_key(Intent(self.principal, self.message_id), action, args, version=version)

    def effect_started(self) -> None:
        """Say, right before it, that the effect this handler cannot take back starts now
        (for a handler declared ``side_effect(..., irreversible=False)``; an irreversible
        one is marked before its call). From then on a timeout, a crash or a lost lease
        sends the task to ``unknown`` for its reconcile, never to a blind retry.

        Raises:
            TaskCancelled: a cancel was requested: do not start the effect.
            StaleError: this attempt no longer holds the task: do not start it.
            ConfigError: the handler declared no side effect.
        """
        if self._effect_started:
            return
        if self._start_effect is None:
            raise ConfigError(
                "effect_started() needs a handler declared with effects.side_effect(...)"
            )
        self._start_effect()
        self._effect_started = True

    @property
    def declares_effect(self) -> bool:
        """Whether the handler declared a side effect it marks itself
        (``side_effect(..., irreversible=False)``)."""
        return self._start_effect is not None

    @property
    def effect_was_started(self) -> bool:
        """Whether this attempt marked its effect started."""
        return self._effect_started

    def time_left_s(self) -> float:
        """Seconds until the absolute deadline (negative once it has passed)."""
        return self.claimed.deadline - self._clock.now()

    def cancelled(self) -> bool:
        """Whether to stop: cancelled, lease lost, timed out or worker stopping.

        Returns:
            True once any of those happened. While it is False this asks the store (one
            short read), so a cancel is seen here before the next lease renewal.
        """
        if self._stopped.is_set():
            return True
        if self._cancel_check is None:
            return False
        seen = self._cancel_check()
        if isinstance(seen, StaleError):
            TaskControl(self).mark_lease_lost(seen)
            return True
        if seen:
            self._mark("cancelled")
            return True
        return False

    def wait_cancelled(self, timeout_s: float | None) -> bool:
        """Block until ``cancelled()`` would turn True through the worker, or the timeout.

        A cancel made in the store is seen at the next lease renewal (not by this wait).

        Args:
            timeout_s: seconds to wait at most; ``None`` waits without limit.

        Returns:
            True if the task is to stop, False if the time ran out first.
        """
        return self._stopped.wait(timeout_s)

    def _mark(self, reason: StopReason) -> None:
        with self._lock:
            if self._reason is None:
                self._reason = reason
        self._stopped.set()

    def __repr__(self) -> str:
        return (
            f"Task(task_id={self.task_id!r}, attempt={self.attempt}, fence={self.fence}, "
            f"owner={self.owner!r})"
        )


class TaskControl:
    """The worker's side of a ``Task``: what the store, the lease keeper and the call
    supervisor tell it. Handlers never use this.

    Args:
        task: the task to act on.
    """

    __slots__ = ("_task",)

    def __init__(self, task: Task) -> None:
        self._task = task

    def mark_cancelled(self) -> None:
        """The store says the task was cancelled."""
        self._task._mark("cancelled")

    def mark_lease_lost(self, exc: StaleError) -> None:
        """A renewal was refused: the lease is gone, any commit will be fenced.

        Args:
            exc: the refusal.
        """
        with self._task._lock:
            if self._task._lease_lost is None:
                self._task._lease_lost = exc
        self._task._mark("lease_lost")

    def mark_stopped(self, reason: Literal["timeout", "stopping"]) -> None:
        """The worker gave up waiting for this call.

        Args:
            reason: ``"timeout"`` (call timeout or deadline) or ``"stopping"`` (shutdown).
        """
        self._task._mark(reason)

    def set_args(self, args: Any) -> None:
        """The payload, validated against the task's model (``Task.args``)."""
        self._task._args = args

    def allow_effect(self, start: Callable[[], None]) -> None:
        """The handler declared a side effect: ``start`` records its start in the store."""
        self._task._start_effect = start

    def note_effect_started(self) -> None:
        """The worker marked the effect started before the call (an irreversible one)."""
        self._task._effect_started = True

    def note_renewed(self, lease_until: float) -> None:
        """Record a successful renewal.

        Args:
            lease_until: the new end of the lease, epoch seconds.
        """
        with self._task._lock:
            self._task._lease_until = max(self._task._lease_until, lease_until)
