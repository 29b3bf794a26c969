"""Bounded handler calls: a batch's calls back to back on a reused call thread.

Invariant kept: no handler runs inside a SQLite transaction (``docs/RULES.md`` rule 9). Calls run
on a daemon call thread while the worker holds no transaction; a ``CallRun`` makes the
calls of a whole batch back to back on one call thread while the worker's thread
supervises them (a hand-over between threads per call cost more than trivial handlers
themselves; call threads are reused from run to run, and an abandoned call keeps its
thread while the run goes on with a new one). This module only *reports* outcomes (a
value, an exception, a timeout) and never writes anything, so the worker commits them
afterwards in the store's own short transaction.

Crash: nothing here is durable. A process killed during a call leaves its task ``running``
until the lease expires; the next claim counts another attempt and raises the fence, and a
handler that keys its external effect by ``Task.idempotency_key`` applies that effect once
(rule 16). A call that outlives its timeout cannot be killed (Python threads cannot be), so it
is abandoned: its ``Task.cancelled()`` turns True and its eventual result is ignored.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from broker_adapter.handler.task import Task, TaskControl
from broker_adapter.stages.shared import tracing
from broker_adapter.stages.shared.handlers import Handler

#: After an async call's timeout, how long its cancelled coroutine may take to unwind.
ASYNC_CANCEL_WAIT_S = 1.0


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


class EventLoopThread:
    """One long-lived asyncio event loop on a daemon thread of its own: every async handler
    of a worker process runs on it (``process_loop``), however many run at once, so
    the clients a handler keeps (HTTP pools, model SDKs) live across calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="handler-event-loop", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, awaitable: Awaitable[Any]) -> Any:
        """Run ``awaitable`` on the loop and wait for its result (raised as it raised). The
        caller's context variables go with it (a tracing span, for one)."""
        return asyncio.run_coroutine_threadsafe(_awaited(awaitable), self.loop).result()


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


_LOOP_LOCK = threading.Lock()
_PROCESS_LOOP: EventLoopThread | None = None


def process_loop() -> EventLoopThread:
    """This process's event loop for async handlers (started at its first use)."""
    global _PROCESS_LOOP
    with _LOOP_LOCK:
        if _PROCESS_LOOP is None or not _PROCESS_LOOP._thread.is_alive():
            _PROCESS_LOOP = EventLoopThread()
        return _PROCESS_LOOP


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


def _call_thread(slot: int = 0) -> _CallThread:
    """The calling thread's call thread of ``slot``, reserved for one call (a new one if it
    is busy)."""
    threads: dict[int, _CallThread] | None = getattr(_CALLERS, "threads", None)
    if threads is None:
        threads = _CALLERS.threads = {}
    current = threads.get(slot)
    if current is not None and current.take():
        return current
    if current is not None:
        current.retire()
    fresh = threads[slot] = _CallThread()
    fresh.take()
    return fresh


class StopRun(Exception):
    """Raised by a ``CallRun``'s ``prepare`` to end the run: the tasks not started are left."""


@dataclass
class _Call:
    """The call in progress on a run's thread."""

    task: Task
    timeout_s: float
    started: float  # time.monotonic()
    is_async: bool = False


@dataclass(frozen=True)
class RunOutcome:
    """One call of a ``CallRun`` that ended (or was abandoned).

    Attributes:
        task: the task it was for.
        outcome: how it ended.
        timeout_s: the timeout it had.
        ended_at: ``time.monotonic()`` when it ended or was abandoned.
    """

    task: Task
    outcome: CallOutcome
    timeout_s: float
    ended_at: float


#: How long a supervising thread waits at most between two looks at its run.
SUPERVISE_S = 0.01


class CallRun:
    """Handler calls for a sequence of tasks, made back to back on a call thread, while
    the thread that owns the run supervises them (``supervise`` + ``wait``).

    Nothing passes between the two threads per call: the call thread records each outcome
    and goes on with the next task; the owner collects the outcomes (``take``) when it
    looks. On this kind of machine a hand-over between two threads (wake one, wait for it,
    get woken back) costs more than a trivial handler; once per run it is cheap.

    For each task the call thread first asks ``prepare(task)`` for the call's timeout
    (``None``: skip the task; raising ``StopRun``: end the run, leaving the rest not
    started), calls the handler (an ``async def`` one on the process's event loop,
    ``process_loop``, cancelled at its timeout), calls ``after()``, and records the outcome.

    A call that outlives its timeout (an async one: its timeout plus
    ``ASYNC_CANCEL_WAIT_S`` to unwind), or the stop grace once ``stop`` is set, is
    abandoned by ``supervise``: its ``Task.cancelled()`` turns True, its outcome is recorded
    as ``timed_out`` / ``stopped``, and the run goes on with the next task on a fresh call
    thread; the stuck thread's eventual result is ignored.

    Args:
        handler: the handler.
        tasks: the tasks, in order.
        prepare: runs on the call thread before each call (see above).
        after: runs on the call thread right after each call returns.
        slot: which of the owner thread's call threads to use (``concurrent_run``: one per
            slot, each reused from run to run).
    """

    def __init__(
        self,
        handler: Handler,
        tasks: list[Task],
        prepare: Callable[[Task], float | None],
        after: Callable[[], None] | None = None,
        slot: int = 0,
    ) -> None:
        self._slot = slot
        self._handler = handler
        self._tasks = tasks
        self._prepare = prepare
        self._after = after
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)
        self._gen = 0  # bumped when the thread of a call is abandoned: it must stop
        self._next = 0
        self._current: _Call | None = None
        self._outcomes: list[RunOutcome] = []
        self._finished = False
        self._error: BaseException | None = None
        self._grace_until: float | None = None
        #: Tasks handed to ``prepare`` (run, skipped or abandoned).
        self.started = 0
        #: Tasks left not started because ``prepare`` raised ``StopRun`` or ``halt``.
        self.not_started = 0
        self._spawn(0)

    # -- the call thread ------------------------------------------------------------------

    def _spawn(self, gen: int) -> None:
        runner = _call_thread(self._slot)

        def body() -> None:
            try:
                self._loop(gen, runner.release)
            finally:
                runner.release()

        runner.submit(body)

    def _loop(self, gen: int, release: Callable[[], None]) -> None:
        while True:
            with self._lock:
                if gen != self._gen:
                    return
                if self._next >= len(self._tasks):
                    # Free for the owner's next run before the owner hears that this one
                    # ended, so that the next run reuses this thread.
                    release()
                    self._finish()
                    return
                task = self._tasks[self._next]
                self._next += 1
                self.started += 1
            try:
                timeout_s = self._prepare(task)
            except StopRun:
                with self._lock:
                    if gen == self._gen:
                        release()
                        self.started -= 1
                        self._stop_here(len(self._tasks) - self._next + 1)
                return
            except BaseException as exc:  # noqa: BLE001 - handed to the owner by take()
                with self._lock:
                    if gen == self._gen:
                        release()
                        self._error = exc
                        self._stop_here(len(self._tasks) - self._next)
                return
            if timeout_s is None:
                continue
            call = _Call(task, timeout_s, time.monotonic())
            with self._lock:
                if gen != self._gen:
                    return
                self._current = call
            with tracing.handler_span(task) as span:  # tracing: current during the call
                outcome = self._call(call)
                span.ended(outcome)
            if self._after is not None:
                self._after()
            with self._lock:
                if gen != self._gen:
                    return  # abandoned meanwhile: supervise recorded its outcome
                self._current = None
                self._outcomes.append(RunOutcome(task, outcome, timeout_s, time.monotonic()))

    def _call(self, call: _Call) -> CallOutcome:
        try:
            value = self._handler(call.task)
            if inspect.isawaitable(value):
                call.is_async = True
                value = process_loop().run(_bounded(value, call.timeout_s))
        except _AsyncTimeout:
            TaskControl(call.task).mark_stopped("timeout")
            return CallOutcome(timed_out=True, elapsed_s=time.monotonic() - call.started)
        except BaseException as exc:  # noqa: BLE001 - whatever a handler raises is its outcome
            return CallOutcome(error=exc, elapsed_s=time.monotonic() - call.started)
        return CallOutcome(value=value, elapsed_s=time.monotonic() - call.started)

    def _stop_here(self, left: int) -> None:
        """End the run now (lock held): ``left`` tasks are not started."""
        self.not_started += max(0, left)
        self._next = len(self._tasks)
        self._finish()

    def _finish(self) -> None:
        self._finished = True
        self._ended.notify_all()

    # -- the owner's side -----------------------------------------------------------------

    def wait(self, timeout_s: float) -> bool:
        """Wait until the run has ended, ``timeout_s`` at most. Returns whether it has."""
        with self._lock:
            if not self._finished and timeout_s > 0:
                self._ended.wait(timeout_s)
            return self._finished

    def take(self) -> list[RunOutcome]:
        """The outcomes recorded since the last ``take``, in the order the calls ended.

        Raises:
            BaseException: what ``prepare`` raised (other than ``StopRun``), once the
                outcomes recorded before it were taken.
        """
        with self._lock:
            out, self._outcomes = self._outcomes, []
            error = self._error if not out else None
            if error is not None:
                self._error = None
        if error is not None:
            raise error
        return out

    def halt(self) -> None:
        """Start no further task; the call in progress, if any, runs on but its outcome is
        dropped (the owner gives up on the run, e.g. after an error of its own)."""
        with self._lock:
            if self._finished:
                return
            self._gen += 1
            self._current = None
            self._stop_here(len(self._tasks) - self._next)

    def supervise(
        self,
        stop: threading.Event | None = None,
        *,
        grace_s: float = 0.0,
        drain_deadline: Callable[[], float] | None = None,
    ) -> float:
        """Abandon the call in progress if it outlived its timeout or the stop grace.

        Args:
            stop: the owner's stop event; once set, the call in progress may run until the
                drain deadline (never past its timeout).
            grace_s: without ``drain_deadline``, the grace counted from the moment the
                stop is first seen here.
            drain_deadline: returns the ``time.monotonic()`` instant a stopping owner must
                be done by.

        Returns:
            how long the owner may wait (``wait``) before it looks again, seconds.
        """
        now = time.monotonic()
        with self._lock:
            if self._finished:
                return 0.0
            if stop is not None and self._grace_until is None and stop.is_set():
                self._grace_until = now + grace_s if drain_deadline is None else drain_deadline()
            call = self._current
            if call is None:
                return SUPERVISE_S
            limit = call.started + call.timeout_s
            if call.is_async:  # cancelled at its timeout on its own loop: time to unwind
                limit += ASYNC_CANCEL_WAIT_S
            ends = limit if self._grace_until is None else min(limit, self._grace_until)
            if now < ends:
                return min(ends - now, SUPERVISE_S)
            reason: Literal["timeout", "stopping"] = "timeout" if now >= limit else "stopping"
            elapsed = now - call.started
            if reason == "timeout":
                outcome = CallOutcome(timed_out=True, elapsed_s=elapsed)
            else:
                outcome = CallOutcome(stopped=True, elapsed_s=elapsed)
            self._gen += 1
            self._current = None
            self._outcomes.append(RunOutcome(call.task, outcome, call.timeout_s, now))
            gen = self._gen
        TaskControl(call.task).mark_stopped(reason)
        self._spawn(gen)  # the rest of the run goes on without the stuck thread
        return 0.0


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
    abandoned with ``stopped``. (A ``CallRun`` of one task.)

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
    run = CallRun(handler, [task], lambda _task: timeout_s)
    while not run.wait(run.supervise(stop, grace_s=grace_s, drain_deadline=drain_deadline)):
        pass
    (ended,) = run.take()
    return ended.outcome
