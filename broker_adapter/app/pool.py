"""A pool of worker processes on one SQLite database.

Invariant kept: no SQLite connection crosses a process boundary. Children are started with
multiprocessing's ``spawn`` context (a fresh interpreter, never ``fork``) and each opens its
own ``Database``; a connection used after ``fork()`` corrupts SQLite's locks. Each child has
its own lease owner name, so owner checks (``docs/RULES.md`` rule 10) tell the workers apart.

Children set up no logging of their own: each forwards its records to this process
(``logforward``), where they go through this process's logging configuration.

Crash: the pool restarts nothing. A child that dies leaves its claimed task ``running`` until
the lease expires; any other worker then takes it back with attempts+1 and fence+1, and the
dead child's late commit, if it ever came, would be fenced. ``stop`` sends SIGTERM: each child
sets its stop event, claims nothing more, lets the running handler finish within its grace
and exits 0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event as ProcessEvent
from pathlib import Path

from broker_adapter.app.logforward import ChildLogs, forward_to_parent
from broker_adapter.app.stop_signals import stop_on_signals
from broker_adapter.errors import ConfigError
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect
from broker_adapter.stages.shared.handlers import load_app
from broker_adapter.stages.shared.handoff import Handoff, HandoffEndpoint
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.stages.worker.worker import Worker
from broker_adapter.store import OutboxStore, TaskStore
from broker_adapter.store.backends import open_store
from broker_adapter.store.gate import WriteGate
from broker_adapter.store.task_types import TaskPolicy
from broker_adapter.store.urls import is_postgres_url

#: How long ``stop`` waits beyond the longest grace before it SIGKILLs a child.
STOP_MARGIN_S = 5.0
#: How long ``stop`` waits for a child still starting up to install its SIGTERM handler.
CHILD_READY_TIMEOUT_S = 30.0


class WorkerPool:
    """N worker processes running the same handler on the same database.

    Args:
        n: how many processes.
        db_path: the SQLite database every child opens for itself.
        handler_spec: ``"module:callable"`` or ``"module:router"`` (a ``Router``),
            importable in a fresh interpreter.
        config_factory: the config of child ``i`` (called in this process, ``i`` from 0);
            the owners must differ.
        policy: the store's policy in every child (lease, backoff); the default if ``None``.
        handoff: give the children a ``Handoff`` (``self.handoff``): idle workers wait on
            it, ``idle_poll_s`` at most, instead of polling every ``wake_poll_s``; whoever
            accepts tasks in this process hands them over with ``accept_and_claim``.
        keyring: signs the replies of children that publish them (``publish_url``); handed
            to each child with its arguments (a pipe to the child, never a file or the
            command line).
        app_dir: a directory put first on the import path, here and in every child,
            before the handler is imported (``handlers.load_handler``).
        publish_url: the Redis of the reply streams: each child publishes the replies of
            its own batches right after their commit (``Worker``); ``None``: they wait in
            the outbox for the dispatcher.
        metrics_dir: each child's counters and handler times (labelled ``handler_spec``)
            go to prometheus-client's multiprocess files there (``app.metrics.WorkerMetrics``);
            ``None``: no metrics, nothing imported.

    The children's writers queue on one ``WriteGate`` (``self.gate``); give it to this
    process's ``Database`` of the same file too (``open_database(db_path, gate=pool.gate)``).

    Raises:
        ConfigError: ``n < 1``, the handler cannot be loaded, two owners are the same, or
            children publish replies and there is no keyring.
    """

    def __init__(
        self,
        n: int,
        db_path: str | Path,
        handler_spec: str,
        config_factory: Callable[[int], WorkerConfig],
        *,
        policy: TaskPolicy | None = None,
        handoff: bool = False,
        keyring: Keyring | None = None,
        app_dir: str | Path | None = None,
        publish_url: str | None = None,
        metrics_dir: Path | None = None,
    ) -> None:
        if n < 1:
            raise ConfigError(f"a worker pool needs at least one process, got {n}")
        self.app_dir = None if app_dir is None else str(Path(app_dir).resolve())
        load_app(handler_spec, app_dir=self.app_dir)  # fail here, not once per child
        self.configs = [config_factory(i) for i in range(n)]
        owners = [c.owner for c in self.configs]
        if len(set(owners)) != n:
            raise ConfigError(f"worker owners must be unique, got {owners}")
        if keyring is None and publish_url is not None:
            raise ConfigError("workers that publish replies need a keyring to sign them")
        self.keyring = keyring
        self.publish_url = publish_url
        self.metrics_dir = None if metrics_dir is None else str(metrics_dir)
        self.db_path = db_path if is_postgres_url(db_path) else Path(db_path)
        self.handler_spec = handler_spec
        self.policy = policy
        self._ctx = multiprocessing.get_context("spawn")
        self._ready: list[ProcessEvent] = []
        self._procs: list[SpawnProcess] = []
        self.restarts = 0
        self.handoff = Handoff(owners) if handoff else None
        self.gate = WriteGate(self._ctx)
        self.logs = ChildLogs(self._ctx)

    def _spawn(self, slot: int) -> tuple[SpawnProcess, ProcessEvent]:
        config = self.configs[slot]
        ready = self._ctx.Event()
        endpoint = None if self.handoff is None else self.handoff.endpoint(slot)
        log_pipe = self.logs.pipe()
        proc = self._ctx.Process(
            target=_child_main,
            args=(
                str(self.db_path),
                self.handler_spec,
                config,
                self.policy,
                ready,
                os.getpid(),
                endpoint,
                self.gate,
                self.keyring,
                self.app_dir,
                log_pipe,
                self.logs.level,
                self.publish_url,
                self.metrics_dir,
            ),
            name=f"ba-worker-{config.owner}",
        )
        try:
            proc.start()
        finally:
            log_pipe.close()  # the child has its own copy of the writing end
            if endpoint is not None:
                endpoint.close()  # the child has its own copy of the reading end
        return proc, ready

    def start(self) -> None:
        """Start the children (once)."""
        if self._procs:
            raise RuntimeError("the pool was already started")
        for slot in range(len(self.configs)):
            proc, ready = self._spawn(slot)
            self._ready.append(ready)
            self._procs.append(proc)

    def replace_dead(self) -> int:
        """Start a new child in place of each one that died (SIGKILL, a handler that killed
        its process). Its claimed task comes back when the lease expires, fenced.

        Returns:
            how many children were replaced.
        """
        replaced = 0
        for i, proc in enumerate(self._procs):
            if proc.exitcode is None:
                continue
            proc.join()
            self._procs[i], self._ready[i] = self._spawn(i)
            self.restarts += 1
            replaced += 1
        return replaced

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    @property
    def exitcodes(self) -> list[int | None]:
        return [p.exitcode for p in self._procs]

    def alive(self) -> int:
        """How many children are running."""
        return sum(p.is_alive() for p in self._procs)

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until every child has opened its database and handles SIGTERM.

        Args:
            timeout_s: seconds to wait at most, in total.

        Returns:
            whether all children are ready.
        """
        deadline = time.monotonic() + timeout_s
        return all(r.wait(max(0.0, deadline - time.monotonic())) for r in self._ready)

    def stop(self, timeout_s: float | None = None) -> list[int | None]:
        """SIGTERM every child and wait for it to drain; SIGKILL what outlives the wait.

        Args:
            timeout_s: how long to wait in total; the longest ``grace_s`` plus
                ``STOP_MARGIN_S`` if ``None``.

        Returns:
            the children's exit codes (0 is a clean drain; ``-9`` was killed).
        """
        if timeout_s is None:
            timeout_s = max(c.grace_s for c in self.configs) + STOP_MARGIN_S
        # A SIGTERM that arrives before the child installed its handler kills it outright:
        # let children that are still starting up get that far first.
        ready_deadline = time.monotonic() + CHILD_READY_TIMEOUT_S
        for proc, ready in zip(self._procs, self._ready, strict=True):
            while proc.is_alive() and not ready.wait(0.05):
                if time.monotonic() > ready_deadline:
                    break
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        if self.handoff is not None:
            self.handoff.close()
        self.logs.close()
        return self.exitcodes

    def __enter__(self) -> WorkerPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _child_main(
    db_path: str,
    handler_spec: str,
    config: WorkerConfig,
    policy: TaskPolicy | None,
    ready: ProcessEvent,
    parent_pid: int,
    handoff: HandoffEndpoint | None = None,
    gate: WriteGate | None = None,
    keyring: Keyring | None = None,
    app_dir: str | None = None,
    log_pipe: Connection | None = None,
    log_level: int = logging.INFO,
    publish_url: str | None = None,
    metrics_dir: str | None = None,
) -> None:
    """A child's whole life: its log records sent to the parent, its own database, one
    worker, SIGTERM/SIGINT to drain.

    A child dies with its parent: a SIGKILLed runner must not leave orphans claiming tasks.
    """
    if log_pipe is not None:
        forward_to_parent(log_pipe, log_level)
    _die_with_parent(parent_pid)
    stop = threading.Event()
    stop_on_signals(stop)
    db = open_store(db_path, gate=gate)
    try:
        metrics = None
        if metrics_dir is not None:
            from broker_adapter.app.metrics import WorkerMetrics

            metrics = WorkerMetrics(Path(metrics_dir), handler_spec)
        worker = Worker(
            config,
            TaskStore(db, policy=policy),
            load_app(handler_spec, app_dir=app_dir),
            handoff=handoff,
            keyring=keyring,
            outbox=OutboxStore(db),
            metrics=metrics,
            redis_client=None if publish_url is None else connect(publish_url),
        )
        ready.set()
        worker.run(stop)
    finally:
        db.close()


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; poll as a fallback."""
    armed = False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        armed = False
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    if armed:
        return

    def watch() -> None:
        while True:
            time.sleep(1.0)  # a watchdog's period, not a wait for a result
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
