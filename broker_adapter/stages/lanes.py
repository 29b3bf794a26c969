"""Several tasks at once in one worker process: ``Lanes`` runs ``concurrency`` workers, each
on a thread of its own, over one store.

Each lane is a whole ``worker.Worker`` with an owner name of its own (the first lane keeps
the process's, and its hand-off), so each task it runs is under its own claim, lease
(renewed by that lane), fence, timeout and cancel check: a lease lost by one task stops
only that task. The lanes share the process's database connection (its writes queue on
one lock), its per-task concurrency limits (``routing.TaskLimits``) and its event loop
(``calls.process_loop``): async handlers of every lane run on that one loop, sync handlers
on each lane's call thread.

Crash: nothing here is durable; a killed process leaves each lane's claimed tasks
``running`` until their leases expire, as one worker would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from broker_adapter.protocol.router import Router
from broker_adapter.stages.handlers import Handler
from broker_adapter.stages.routing import TaskLimits
from broker_adapter.stages.worker import Worker, WorkerConfig


def lane_owner(owner: str, lane: int) -> str:
    """The owner name of lane ``lane`` of a worker named ``owner`` (lane 0 keeps it)."""
    return owner if lane == 0 else f"{owner}.{lane}"


class Lanes:
    """``config.concurrency`` workers of one process (see the module).

    Args:
        config: the process's worker settings (``concurrency`` lanes; ``owner`` is lane 0's).
        handler: the router (or handler) every lane serves.
        make: builds one lane's worker from its config, its handler, its hand-off (lane 0
            only: the others get ``None``) and the shared limits, e.g.
            ``lambda cfg, h, handoff, limits: Worker(cfg, store, h, handoff=handoff,
            limits=limits)``.
        handoff: the process's end of the ingest's hand-off, given to lane 0.
    """

    def __init__(
        self,
        config: WorkerConfig,
        handler: Router | Handler,
        make: Callable[[WorkerConfig, Router | Handler, Any, TaskLimits], Worker],
        handoff: Any = None,
    ) -> None:
        router = handler if isinstance(handler, Router) else Router.of_handler(handler)
        self.limits = TaskLimits(router)
        self.workers = [
            make(
                config.model_copy(update={"owner": lane_owner(config.owner, lane)}),
                router,
                handoff if lane == 0 else None,
                self.limits,
            )
            for lane in range(config.concurrency)
        ]

    def run(self, stop: threading.Event) -> None:
        """Run every lane until ``stop`` is set and each has drained (``Worker.run``).

        Raises:
            BaseException: the first error a lane stopped on (after every lane stopped).
        """
        errors: list[BaseException] = []

        def lane(worker: Worker) -> None:
            try:
                worker.run(stop)
            except BaseException as exc:  # noqa: BLE001 - re-raised by run once all stop
                errors.append(exc)
                stop.set()  # one lane down: the process drains and the pool replaces it

        threads = [
            threading.Thread(target=lane, args=(w,), name=f"lane-{i}", daemon=True)
            for i, w in enumerate(self.workers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
