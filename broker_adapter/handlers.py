"""Handlers: loading ``module:callable`` specs, the ``Task`` a handler sees, and one bounded call.

Invariant kept: no handler runs inside a SQLite transaction (INVARIANTS rule 9). A call runs
on a daemon thread while the worker holds no transaction (one call thread per calling
thread, reused from call to call while its calls end; an abandoned call keeps its thread and
the next call gets a new one: starting a thread per call cost more than the trivial
handlers themselves); this module only
*reports* the outcome (a value, an exception, a timeout) and never writes anything, so the
worker commits it afterwards in the store's own short transaction.

Crash: nothing here is durable. A process killed during a call leaves its task ``running``
until the lease expires; the next claim counts another attempt and raises the fence, and a
handler that keys its external effect by ``Task.idempotency_key`` applies that effect once
(rule 16). A call that outlives its timeout cannot be killed (Python threads cannot be), so it
is abandoned: its ``Task.cancelled()`` turns True and its eventual result is ignored.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

from broker_adapter.clock import Clock, SystemClock
from broker_adapter.errors import ConfigError, StaleError
from broker_adapter.store.tasks import ClaimedTask

#: A handler takes one ``Task`` and returns a JSON value, or an awaitable of one.
Handler = Callable[["Task"], Any]

#: Why a task's ``cancelled()`` turned True.
StopReason = Literal["cancelled", "lease_lost", "timeout", "stopping"]

ERROR_TEXT_MAX_CHARS = 4000
#: After an async call's timeout, how long its cancelled coroutine may take to unwind.
ASYNC_CANCEL_WAIT_S = 1.0
#: How often a call waiting for its handler looks at the worker's stop event.
STOP_CHECK_S = 0.05


class RetryableError(Exception):
    """Raise from a handler to ask for another attempt.

    The store decides whether there is one (attempt budget, backoff, deadline). Any other
    exception class with a class or instance attribute ``retryable = True`` counts too.
    """

    retryable = True


def is_retryable(exc: BaseException) -> bool:
    """Whether a handler's exception asks for another attempt.

    Args:
        exc: what the handler raised.

    Returns:
        True for ``RetryableError`` and for any exception whose ``retryable`` is ``True``.
    """
    return isinstance(exc, RetryableError) or getattr(exc, "retryable", False) is True


def describe_error(exc: BaseException) -> str:
    """The error text carried in a reply: ``"ExcType: message"``, capped in length.

    Args:
        exc: the exception to describe.

    Returns:
        ``"ExcType: message"`` (just ``"ExcType"`` if the message is empty), at most
        ``ERROR_TEXT_MAX_CHARS`` characters.
    """
    text = str(exc)
    out = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if len(out) > ERROR_TEXT_MAX_CHARS:
        out = out[: ERROR_TEXT_MAX_CHARS - 1] + "…"
    return out


class Task:
    """What a handler receives: the claimed task, plus a cancellation check.

    ``cancelled()`` turns True once the task was cancelled (seen in the store, or refused at a
    lease renewal), the lease was lost, the call timed out, or the worker stopped past its
    grace. After that the worker commits nothing the handler returns: stop early.

    Args:
        claimed: the claim as the store returned it.
        clock: the time source used for ``time_left_s``.
        cancel_check: asks the store whether the task was cancelled (``None``: never asks).
    """

    def __init__(
        self,
        claimed: ClaimedTask,
        *,
        clock: Clock | None = None,
        cancel_check: Callable[[], bool] | None = None,
    ) -> None:
        self.claimed = claimed
        self._clock = clock or SystemClock()
        self._cancel_check = cancel_check
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._reason: StopReason | None = None
        self._lease_lost: StaleError | None = None
        self._lease_until = claimed.lease_until

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
    def idempotency_key(self) -> str:
        """Stable across attempts and fences: key every external effect by it."""
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
        if self._cancel_check is not None and self._cancel_check():
            self.mark_cancelled()
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

    # -- what the worker writes -----------------------------------------------------------

    def mark_cancelled(self) -> None:
        """The store says the task was cancelled (worker side)."""
        self._mark("cancelled")

    def mark_lease_lost(self, exc: StaleError) -> None:
        """A renewal was refused: the lease is gone, any commit will be fenced (worker side).

        Args:
            exc: the refusal.
        """
        with self._lock:
            if self._lease_lost is None:
                self._lease_lost = exc
        self._mark("lease_lost")

    def mark_stopped(self, reason: Literal["timeout", "stopping"]) -> None:
        """The worker gave up waiting for this call (worker side).

        Args:
            reason: ``"timeout"`` (call timeout or deadline) or ``"stopping"`` (shutdown).
        """
        self._mark(reason)

    def note_renewed(self, lease_until: float) -> None:
        """Record a successful renewal (worker side).

        Args:
            lease_until: the new end of the lease, epoch seconds.
        """
        with self._lock:
            self._lease_until = max(self._lease_until, lease_until)

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


def load_handler(spec: str) -> Handler:
    """Import the handler named by ``"package.module:callable"``.

    The part after the colon may be dotted (``"pkg.mod:Class.method"``).

    Args:
        spec: the handler's import path.

    Returns:
        the callable (sync, or ``async def``).

    Raises:
        ConfigError: the spec is malformed, the module is not found or fails to import, the
            attribute is missing, or the object is not callable with one argument.
    """
    module_name, sep, attr_path = spec.strip().partition(":")
    names_ok = all(p.isidentifier() for p in module_name.split(".")) and all(
        p.isidentifier() for p in attr_path.split(".")
    )
    if not sep or not module_name or not attr_path or not names_ok:
        raise ConfigError(
            f"handler {spec!r} is malformed: expected 'package.module:callable', "
            "e.g. 'myapp.handlers:summarise'"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ConfigError(f"handler {spec!r}: module {module_name!r} not found") from exc
        raise ConfigError(
            f"handler {spec!r}: importing {module_name!r} failed: {describe_error(exc)}"
        ) from exc
    except Exception as exc:
        raise ConfigError(
            f"handler {spec!r}: importing {module_name!r} failed: {describe_error(exc)}"
        ) from exc
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(
                f"handler {spec!r}: module {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not callable(obj):
        raise ConfigError(
            f"handler {spec!r}: {attr_path!r} is a {type(obj).__name__}, not callable"
        )
    _check_arity(spec, obj)
    return cast(Handler, obj)


def _check_arity(spec: str, obj: Callable[..., Any]) -> None:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # some builtins have no signature: trust them
        return
    try:
        signature.bind(None)
    except TypeError:
        raise ConfigError(
            f"handler {spec!r} must accept one positional argument (the task); "
            f"its signature is {signature}"
        ) from None


@dataclass(frozen=True)
class CallOutcome:
    """How one handler call ended.

    Attributes:
        value: what the handler returned (meaningful when ``ok``).
        error: what it raised, if anything.
        timed_out: it did not return within its call timeout.
        stopped: the worker stopped and the call outlived the grace period.
        elapsed_s: wall time spent waiting for it, seconds.
    """

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    stopped: bool = False
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and not self.stopped


class _AsyncTimeout(Exception):
    """Internal: an async handler did not finish in time (never a handler's own error)."""


async def _bounded(awaitable: Awaitable[Any], timeout_s: float) -> Any:
    future = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({future}, timeout=timeout_s)
    if future in done:
        return future.result()
    future.cancel()
    await asyncio.wait({future}, timeout=ASYNC_CANCEL_WAIT_S)
    if future.done() and not future.cancelled():
        future.exception()  # retrieved, so asyncio does not log it as never retrieved
    raise _AsyncTimeout


class _CallThread:
    """A daemon thread that runs one caller thread's handler calls, one after another.

    Reused while its calls end. A call that is abandoned (timeout, stop) keeps it busy: the
    next call gets a fresh thread, and this one ends once the stuck call returns. An idle
    thread ends after ``IDLE_EXIT_S``.
    """

    IDLE_EXIT_S = 5.0

    def __init__(self) -> None:
        self._todo: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._busy = False
        self._retired = False
        threading.Thread(target=self._loop, name="handler-calls", daemon=True).start()

    def take(self) -> bool:
        """Reserve this thread for one call; False if it is busy or has ended."""
        with self._lock:
            if self._busy or self._retired:
                return False
            self._busy = True
            return True

    def release(self) -> None:
        """The reserved call ended (called on this thread, before the caller is told)."""
        with self._lock:
            self._busy = False

    def retire(self) -> None:
        """End after the call in progress, if any."""
        with self._lock:
            self._retired = True
        self._todo.put(None)

    def submit(self, fn: Callable[[], None]) -> None:
        self._todo.put(fn)

    def _loop(self) -> None:
        while True:
            try:
                fn = self._todo.get(timeout=self.IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._busy:  # reserved, its call is on the way
                        continue
                    self._retired = True
                return
            if fn is None:
                return
            fn()


_CALLERS = threading.local()


def _call_thread() -> _CallThread:
    """The calling thread's call thread, reserved for one call (a new one if it is busy)."""
    current: _CallThread | None = getattr(_CALLERS, "thread", None)
    if current is not None and current.take():
        return current
    if current is not None:
        current.retire()
    fresh = _CALLERS.thread = _CallThread()
    fresh.take()
    return fresh


class HandlerCall:
    """One handler call on a daemon thread (the calling thread's reusable call thread).

    An ``async def`` handler's coroutine runs on a fresh event loop on that thread
    (``asyncio.run``), bounded by ``timeout_s``: at the timeout it is cancelled.

    Args:
        handler: the handler.
        task: its one argument.
        timeout_s: the async timeout; the caller bounds its own wait for sync handlers.
    """

    def __init__(self, handler: Handler, task: Task, timeout_s: float) -> None:
        self._handler = handler
        self._task = task
        self._timeout_s = timeout_s
        self._done = threading.Event()
        self._is_async = False
        self._outcome: CallOutcome | None = None
        self._started = 0.0
        self._release: Callable[[], None] | None = None

    def start(self) -> HandlerCall:
        """Start the call on a call thread. Returns ``self``."""
        self._started = time.monotonic()
        runner = _call_thread()
        self._release = runner.release
        runner.submit(self._run)
        return self

    @property
    def is_async(self) -> bool:
        """Whether the handler returned an awaitable (known once it has started)."""
        return self._is_async

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None) -> bool:
        """Wait for the call to end. Returns whether it has."""
        return self._done.wait(timeout_s)

    def outcome(self) -> CallOutcome:
        """The call's outcome.

        Raises:
            RuntimeError: the call has not ended yet.
        """
        if self._outcome is None:
            raise RuntimeError("the handler call has not ended")
        return self._outcome

    def _run(self) -> None:
        try:
            value = self._handler(self._task)
            if inspect.isawaitable(value):
                self._is_async = True
                value = asyncio.run(_bounded(value, self._timeout_s))
        except _AsyncTimeout:
            self._task.mark_stopped("timeout")
            outcome = CallOutcome(timed_out=True, elapsed_s=self._elapsed())
        except BaseException as exc:  # noqa: BLE001 - whatever a handler raises is its outcome
            outcome = CallOutcome(error=exc, elapsed_s=self._elapsed())
        else:
            outcome = CallOutcome(value=value, elapsed_s=self._elapsed())
        self._outcome = outcome
        if self._release is not None:
            self._release()  # before the caller hears of it: its next call may reuse us
        self._done.set()

    def _elapsed(self) -> float:
        return time.monotonic() - self._started


def call_handler(
    handler: Handler,
    task: Task,
    timeout_s: float,
    *,
    stop: threading.Event | None = None,
    grace_s: float = 0.0,
    drain_deadline: Callable[[], float] | None = None,
) -> CallOutcome:
    """Run ``handler(task)`` and wait for it, at most ``timeout_s`` seconds.

    A call that does not end in time is abandoned: ``task.cancelled()`` turns True (so a
    cooperative handler stops) and the outcome says ``timed_out``. If ``stop`` is set while
    waiting, the call may run until the drain deadline (never past its timeout) and is then
    abandoned with ``stopped``.

    Args:
        handler: the handler to call.
        task: its argument.
        timeout_s: the per-call timeout, seconds (already capped by the deadline).
        stop: the worker's stop event, or ``None``.
        grace_s: how long a stopping worker waits for the running call, seconds, counted
            from the moment the stop is seen here.
        drain_deadline: instead of ``grace_s``: returns the ``time.monotonic()`` instant by
            which a stopping worker must be done (a worker draining a batch shares one).

    Returns:
        the outcome. Never raises what the handler raised.
    """
    call = HandlerCall(handler, task, timeout_s).start()
    started = time.monotonic()
    limit = started + timeout_s
    grace_until: float | None = None
    extended = False
    while True:
        ends = limit if grace_until is None else min(limit, grace_until)
        step = ends - time.monotonic()
        if stop is not None and grace_until is None:
            step = min(step, STOP_CHECK_S)
        if call.wait(max(step, 0.0)):
            return call.outcome()
        now = time.monotonic()
        if stop is not None and grace_until is None and stop.is_set():
            grace_until = now + grace_s if drain_deadline is None else drain_deadline()
            continue
        if grace_until is not None and now >= grace_until:
            task.mark_stopped("stopping")
            return CallOutcome(stopped=True, elapsed_s=now - started)
        if now >= limit:
            if call.is_async and not extended:
                # The coroutine is cancelled on its own thread at the same timeout; give it
                # a moment to unwind and report, rather than abandoning the thread at once.
                extended = True
                limit = now + ASYNC_CANCEL_WAIT_S
                continue
            task.mark_stopped("timeout")
            return CallOutcome(timed_out=True, elapsed_s=now - started)
