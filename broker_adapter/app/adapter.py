"""Wires the stages into one running adapter: ingest, N worker processes, the dispatcher.

The stages never call each other; they meet only in the SQLite file and in Redis, plus
one shortcut: the ingest's accept transaction claims new tasks for the workers that wait
idle and tells each which (``handoff``; a worker that hears nothing still finds its work
by claiming). Each thread and each process opens its own ``Database`` (no connection
crosses a thread or a ``fork``); worker processes are started with ``spawn``.

Lifecycle: ``Adapter.run(stop)`` returns after ``stop`` is set (SIGTERM / SIGINT in the CLI):
ingest and the dispatcher finish their current batch, the workers stop claiming and let the
running handlers finish within ``grace_s``. A worker process that dies (SIGKILL, a handler
that kills it) is replaced; its claimed task comes back to the pool when its lease expires,
with attempts+1 and fence+1, and the dead process's late commit, if any, is fenced.
A whole-runner SIGKILL loses nothing either: ingested entries are in SQLite before they are
acknowledged, replies are in the outbox before they are published.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Literal, TypeVar

from broker_adapter.app.adapter_config import AdapterConfig
from broker_adapter.app.binding import PrefixGuard, bind, claim_name, refuse_sqlite_copies
from broker_adapter.app.metrics import Observed
from broker_adapter.app.pool import WorkerPool
from broker_adapter.app.serving import serve_metrics
from broker_adapter.app.stop_signals import stop_on_signals
from broker_adapter.backoff import call_until_stopped
from broker_adapter.clock import SystemClock
from broker_adapter.config import derive
from broker_adapter.errors import (
    BrokerAdapterError,
    ConfigError,
    StageError,
    StoreBusy,
    TransientError,
)
from broker_adapter.handler.effects import EffectSpec, effect_spec
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import Redis, connect
from broker_adapter.redis.functions import load_at_start
from broker_adapter.stages.dispatch.dispatcher import Dispatcher, DispatcherConfig
from broker_adapter.stages.ingest.ingest import Ingestor
from broker_adapter.stages.reconcile.reconciler import Reconciler, run_reconciles
from broker_adapter.stages.shared.handlers import load_app
from broker_adapter.stages.shared.handoff import Handoff
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.store import OutboxStore, TaskStore
from broker_adapter.store.approvals import ApprovalStore
from broker_adapter.store.backends import open_store
from broker_adapter.store.db import Database
from broker_adapter.store.dbclock import report_clock_skew
from broker_adapter.store.effects import EffectsStore
from broker_adapter.store.gate import WriteGate
from broker_adapter.store.identity import StoreIdentity, store_identity
from broker_adapter.store.retention import PurgeSchedule, run_purges
from broker_adapter.store.task_types import TaskPolicy
from broker_adapter.store.urls import redacted_url

if TYPE_CHECKING:
    from broker_adapter.store.postgres import PgDatabase

__all__ = ["Adapter"]

log = logging.getLogger("broker_adapter.app.adapter")
S = TypeVar("S")

SUPERVISE_EVERY_S = 0.5
#: Workers start after the dispatcher's first look at Redis, or after this long at most.
FIRST_LOOK_TIMEOUT_S = 5.0
#: A database locked at start-up is tried again after this pause, doubling up to the max.
DB_WAIT_FIRST_S = 0.1
DB_WAIT_MAX_S = 5.0


def stages_down(threads: Iterable[threading.Thread], pool: WorkerPool) -> list[str]:
    """The runner's stages that do not run: its threads by name, ``workers`` when no
    worker process is alive (what ``/healthz`` reports, ``Observed.stages``)."""
    down = [t.name for t in threads if not t.is_alive()]
    return down if pool.alive() else [*down, "workers"]


class Adapter:
    """Runs the whole adapter until told to stop.

    Args:
        config: validated settings.
        logger: where progress and alarms go.
    """

    def __init__(self, config: AdapterConfig, logger: logging.Logger | None = None) -> None:
        self.config = config
        self.log = logger or log
        assert config.keyring_path is not None  # AdapterConfig requires it
        self.keyring = Keyring.load(config.keyring_path)
        keyless = [p for p in config.ingest.acl_principals if not self.keyring.key_ids(p)]
        if config.ingest.mode == "acl" and keyless:
            raise ConfigError(
                f"keyring {config.keyring_path} has no keys for ACL principal(s) "
                f"{', '.join(keyless)}: their replies could not be signed"
            )
        # The pool imports it again (a cached module); importing it here first means a
        # handler that cannot be found is refused before anything starts.
        self.router = load_app(config.handler, app_dir=config.app_dir)
        #: The side effects the tasks declare (``handler.effects.side_effect``), by task name: with
        #: one, a reconcile thread releases approval waits and reconciles ``unknown`` tasks.
        #: (``None``: what an envelope without a name goes to, the router's default).
        routes = {name: self.router.get(name) for name in (None, *self.router.names)}
        self.effects: dict[str | None, EffectSpec] = {
            name: e
            for name, t in routes.items()
            if t is not None and (e := effect_spec(t.handler)) is not None
        }
        #: The first of them (the one a router of one declares), or ``None``.
        self.effect: EffectSpec | None = next(iter(self.effects.values()), None)
        self.policy = derive(TaskPolicy, config, config.tasks)
        #: The store's identity (read with the database's first open), and this adapter's
        #: consumer name once it holds it (``run``).
        self.identity: StoreIdentity | None = None
        self.name = config.name or "adapter"
        # Create and migrate once, up front (a bad path or a newer schema fails here); a
        # database that another writer keeps locked is waited for in ``run``.
        self._db_ready = self._prepare_database()
        #: The first error each stage thread stopped on, with the stage's name.
        self.errors: list[tuple[str, BaseException]] = []
        self._first_look = threading.Event()
        #: The stages a metrics scrape reads; filled as they start.
        self.observed = Observed(
            db_path=config.db_path,
            redis_url=config.redis_url,
            streams=[Keys(config.prefix).replies(p) for p in self.keyring.principals],
        )

    def _prepare_database(self) -> bool:
        try:
            db = open_store(self.config.db_path)
            try:
                report_clock_skew(db, self.log)
                self.identity = store_identity(db)
            finally:
                db.close()
        except StoreBusy as exc:
            self.log.warning("database busy at start-up, waiting for it: %s", exc)
            return False
        return True

    def _wait_for_database(self, stop: threading.Event) -> bool:
        """Retry ``_prepare_database`` with a growing pause until it succeeds or ``stop``."""
        pause = DB_WAIT_FIRST_S
        while not self._db_ready:
            if stop.wait(pause):
                return False
            pause = min(pause * 2, DB_WAIT_MAX_S)
            self._db_ready = self._prepare_database()
        return True

    def _worker_config(self, i: int) -> WorkerConfig:
        return derive(
            WorkerConfig,
            self.config,
            self.config.worker,
            # unique per incarnation: a leftover of an earlier run never shares an owner name
            owner=f"{self.name}-w{i}-{os.getpid()}",
            record_ttl_s=self._dispatcher_config().record_window_s,
        )

    def _dispatcher_config(self) -> DispatcherConfig:
        return derive(DispatcherConfig, self.config, owner=f"{self.name}-dispatcher")

    def _pool(self) -> WorkerPool:
        return WorkerPool(
            self.config.workers,
            self.config.db_path,
            self.config.handler,
            self._worker_config,
            policy=self.policy,
            handoff=True,
            keyring=self.keyring,
            app_dir=self.config.app_dir,
            publish_url=self.config.redis_url if self.config.worker_publish else None,
            metrics_dir=self.observed.worker_dir,
        )

    def _thread(self, name: str, body: Callable[[], None]) -> threading.Thread:
        def guarded() -> None:
            try:
                body()
            except BrokerAdapterError as exc:  # one of ours: its message says it all
                self.log.error("%s stopped: %s", name, exc)
                self.errors.append((name, exc))
            except BaseException as exc:  # a bug: the traceback is what a report needs
                self.log.exception("%s stopped on an unexpected error", name)
                self.errors.append((name, exc))

        thread = threading.Thread(target=guarded, name=name, daemon=True)
        thread.start()
        return thread

    def _store(
        self,
        stop: threading.Event,
        gate: WriteGate | None,
        make: Callable[[Database | PgDatabase], S],
    ) -> S | None:
        """A stage's own store (``make`` of a database of its own; the caller closes its
        ``db``), or ``None`` once ``stop`` is set. Opening the database and the store's first
        read are retried with the stages' backoff while it is busy or its connection was
        lost (``StoreBusy``), as their loops retry any transaction."""

        def attempt() -> S:
            db = open_store(self.config.db_path, gate=gate)
            try:
                return make(db)
            except BaseException:
                db.close()
                raise

        return call_until_stopped(stop, attempt)

    def _connect(self, stop: threading.Event) -> Redis | None:
        """A stage's Redis client, or ``None`` once ``stop`` is set. A single server's
        client connects at its first command, a cluster's reads the slot map when it is
        made: with its seed node down (restarting) that fails at once, so it is retried
        with the stages' backoff, as their loops retry any command."""
        return call_until_stopped(stop, lambda: connect(self.config.redis_url))

    def _ingest(
        self, stop: threading.Event, handoff: Handoff | None, gate: WriteGate | None
    ) -> None:
        tasks = self._store(stop, gate, lambda db: TaskStore(db, SystemClock(), self.policy))
        if tasks is None:
            return  # stopped before the database could be opened
        try:
            ingest_cfg = self.config.ingest_config(f"{self.name}-ingest")
            client = self._connect(stop)
            if client is None:
                return  # stopped before Redis could be reached
            load_at_start(client, self.log)  # ba_dead_letter, for receivers too
            ingestor = Ingestor(
                ingest_cfg, client, tasks, self.keyring, logger=self.log, handoff=handoff
            )
            self.observed.add_ingestor(ingestor)
            ingestor.run(stop)
        finally:
            tasks.db.close()

    def _dispatch(self, stop: threading.Event, gate: WriteGate | None) -> None:
        outbox = self._store(stop, gate, lambda db: OutboxStore(db, SystemClock()))
        if outbox is None:
            return  # stopped before the database could be opened
        try:
            client = self._connect(stop)
            if client is None:
                return  # stopped before Redis could be reached
            dispatch_cfg = self._dispatcher_config()
            dispatcher = Dispatcher(
                dispatch_cfg, client, outbox, keyring=self.keyring, logger=self.log
            )
            self.observed.dispatchers.append(dispatcher)
            # Its first look (the data-loss watch) comes before any worker publishes: a
            # worker's reply marked sent before it would read as a wipe at start-up.
            try:
                dispatcher.watch()
            except TransientError as exc:
                self.log.warning("first look at Redis failed, will retry: %s", exc)
            finally:
                self._first_look.set()
            dispatcher.run(stop)
        finally:
            self._first_look.set()
            outbox.db.close()

    def _purge(self, stop: threading.Event, gate: WriteGate | None) -> None:
        """Forget requests past the retention window, in small batches between the live
        writers' transactions (``store.retention``), on a connection of its own."""
        clock = SystemClock()
        tasks = self._store(stop, gate, lambda db: TaskStore(db, clock, self.policy))
        if tasks is None:
            return  # stopped before the database could be opened
        try:
            run_purges(stop, tasks.purge_batch, PurgeSchedule(clock, self.log))
        finally:
            tasks.db.close()

    def _reconcile(self, stop: threading.Event, gate: WriteGate | None) -> None:
        """For a handler that declared a side effect: release approval waits and reconcile
        ``unknown`` tasks (``stages.reconcile.reconciler.run_reconciles``), on a connection
        of its own. Each reconcile holds its task under a lease and a fence, and its function
        is called with a timeout, outside any transaction."""
        assert self.effect is not None
        db = open_store(self.config.db_path, gate=gate)
        try:
            tasks = TaskStore(db, SystemClock(), self.policy)
            owner = f"{self.name}-reconciler-{os.getpid()}"
            reconciler = Reconciler(
                EffectsStore(tasks.tx),
                self.effect,
                owner,
                self.config.reconcile,
                by_task=self.effects,
            )
            run_reconciles(stop, reconciler, ApprovalStore(tasks.tx), self.log)
        finally:
            db.close()

    def run_forever(
        self, *, log_level: int = logging.INFO, log_format: Literal["text", "json"] = "text"
    ) -> int:
        """Run until SIGTERM or SIGINT, then drain (``run``), as ``broker-adapter run`` does:
        sets up logging to stderr (``app.logs.configure``: a root logger that has handlers
        already is left alone) and installs the two signal handlers (the previous ones are
        put back on return). Call it from the main thread of the main module, under
        ``if __name__ == "__main__":`` (the workers are started with ``spawn``, which
        imports the main module again in every worker process).

        Returns:
            the exit code (0 after a clean drain).

        Raises:
            ConfigError: called in a worker process (the main module has no ``__main__``
                guard), or not from the main thread, or a stage refused its configuration.
            StageError: a stage stopped on any other error.
        """
        from broker_adapter.app.logs import configure

        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "run_forever() installs signal handlers: call it from the main thread"
                " (or use run(stop) with a stop event of your own)"
            )
        configure(log_level, log_format)
        stop = threading.Event()
        restore = stop_on_signals(stop)
        try:
            return self.run(stop)
        finally:
            restore()

    def run(self, stop: threading.Event) -> int:
        """Run until ``stop`` is set. Returns the exit code (0 after a clean drain).

        Raises:
            ConfigError: called in a worker process (the main module that made the adapter
                has no ``if __name__ == "__main__":`` guard, and ``spawn`` imported it
                again), or a stage refused its configuration (the message names the stage).
            StageError: a stage stopped on any other error (a runtime failure).
        """
        if multiprocessing.parent_process() is not None:
            raise ConfigError(
                "the adapter was started in a worker process: the main module runs it at"
                ' import time; put the code that runs it under if __name__ == "__main__":'
            )
        cfg = self.config
        if not self._wait_for_database(stop):
            return 0  # stopped before the database could be opened: nothing ran
        guard = self._bind(stop)
        if guard is None:
            return 0  # stopped before Redis could be reached: nothing ran
        try:
            self.log.info(
                "broker-adapter running: %d workers, db %s, handler %s, consumer %s",
                cfg.workers,
                redacted_url(cfg.db_path) if isinstance(cfg.db_path, str) else cfg.db_path,
                cfg.handler,
                self.name,
            )
            with serve_metrics(self.observed, cfg.metrics.host, cfg.metrics.port):
                return self._run(stop, guard)
        finally:
            guard.release()

    def _bind(self, stop: threading.Event) -> PrefixGuard | None:
        """Bind the prefix to this store and claim a consumer name (``binding``), before
        any stage starts; Redis outages are waited out.

        Raises:
            BindingRefused: the prefix is bound to another store, or ``--name`` is held.
        """
        assert self.identity is not None  # read by _prepare_database
        identity, keys = self.identity, Keys(self.config.prefix)

        def attempt() -> PrefixGuard:
            client = connect(self.config.redis_url)
            bind(
                client,
                keys.store_binding(),
                identity,
                what=f"prefix {keys.prefix!r}",
                logger=self.log,
            )
            refuse_sqlite_copies(client, keys, identity)
            claim = claim_name(client, keys, identity, self.config.name, logger=self.log)
            return PrefixGuard(client, keys, identity, claim, logger=self.log)

        guard = call_until_stopped(stop, attempt)
        if guard is not None:
            self.name = guard.claim.name
        return guard

    def _run(self, stop: threading.Event, guard: PrefixGuard) -> int:
        cfg = self.config
        pool = self._pool()
        threads = [
            self._thread("binding", lambda: guard.run(stop)),
            self._thread("dispatcher", lambda: self._dispatch(stop, pool.gate)),
            self._thread("ingest", lambda: self._ingest(stop, pool.handoff, pool.gate)),
            self._thread("purge", lambda: self._purge(stop, pool.gate)),
        ]
        if self.effect is not None:
            threads.append(self._thread("reconcile", lambda: self._reconcile(stop, pool.gate)))
        self.observed.stages = partial(stages_down, threads, pool)
        self._first_look.wait(FIRST_LOOK_TIMEOUT_S)
        pool.start()
        try:
            while not stop.wait(SUPERVISE_EVERY_S):
                if self.errors:
                    stop.set()
                    break
                dead = pool.replace_dead()
                if dead:
                    self.log.warning("replaced %d dead worker process(es)", dead)
        finally:
            stop.set()
            codes = pool.stop()
            for thread in threads:
                thread.join(timeout=cfg.worker.grace_s + 10)
        if self.errors:
            stage, exc = self.errors[0]
            if isinstance(exc, ConfigError):
                raise ConfigError(f"{stage}: {exc}") from exc
            raise StageError(stage, exc) from exc
        return 0 if all(code == 0 for code in codes) else 1
