"""A worker process for crash tests: ``python -m tests.support.worker_script <mode> ...``.

Modes:

* ``drain``: one ``Worker`` claims and processes tasks until nothing is left to claim (or
  ``--max-tasks`` were processed), then prints ``STATS <json>`` and exits 0. ``--now`` runs
  it on a ``FakeClock`` fixed at that time, so a test moves time by passing a later value to
  the next process instead of sleeping.
* ``pool``: a ``WorkerPool`` of ``--workers`` processes on the real clock; prints
  ``READY`` once every child is up, drains on SIGTERM, prints ``EXITCODES <json>`` and exits
  0 only if every child exited 0.

Crash points come from the environment (``BA_CRASHPOINT`` / ``BA_PAUSEPOINT``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from broker_adapter.app.pool import WorkerPool
from broker_adapter.clock import FakeClock
from broker_adapter.redis.client import connect
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.stages.worker.worker import Worker
from broker_adapter.store import OutboxStore, TaskStore
from broker_adapter.store.backends import open_store
from broker_adapter.store.task_types import TaskPolicy
from tests.support.replies_script import reply_keyring


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="worker_script")
    parser.add_argument("mode", choices=("drain", "pool"))
    parser.add_argument("--db", required=True)
    parser.add_argument("--handler", required=True)
    parser.add_argument("--owner", default="w1")
    parser.add_argument("--now", type=float, default=None, help="FakeClock time (drain only)")
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--max-tasks", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--call-timeout-s", type=float, default=60.0)
    parser.add_argument("--renew-every-s", type=float, default=None)
    parser.add_argument("--idle-poll-s", type=float, default=0.05)
    parser.add_argument("--grace-s", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--redis-url", default=None, help="the worker publishes its replies")
    parser.add_argument("--prefix", default="ba")
    return parser


def _say(line: str) -> None:
    print(line, flush=True)


def drain(args: argparse.Namespace) -> int:
    clock = FakeClock(args.now) if args.now is not None else None
    db = open_store(args.db)  # a SQLite file or a postgresql:// URL
    try:
        tasks = TaskStore(db, clock, TaskPolicy(lease_s=args.lease_s))
        config = WorkerConfig(
            owner=args.owner,
            batch=args.batch,
            call_timeout_s=args.call_timeout_s,
            renew_every_s=args.renew_every_s,
            prefix=args.prefix,
        )
        publishes = args.redis_url is not None
        worker = Worker(
            config,
            tasks,
            args.handler,
            keyring=reply_keyring() if publishes else None,
            outbox=OutboxStore(db, clock),
            redis_client=connect(args.redis_url) if publishes else None,
        )
        _say("READY")
        total = 0
        while args.max_tasks is None or total < args.max_tasks:
            left = None if args.max_tasks is None else args.max_tasks - total
            processed = worker.run_once(left)
            if processed == 0:
                break
            total += processed
        _say("STATS " + json.dumps(dataclasses.asdict(worker.stats), sort_keys=True))
    finally:
        db.close()
    return 0


def pool(args: argparse.Namespace) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)

    def config_for(i: int) -> WorkerConfig:
        return WorkerConfig(
            owner=f"{args.owner}-{i}",
            batch=args.batch,
            call_timeout_s=args.call_timeout_s,
            renew_every_s=args.renew_every_s,
            idle_poll_s=args.idle_poll_s,
            grace_s=args.grace_s,
        )

    workers = WorkerPool(
        args.workers, args.db, args.handler, config_for, policy=TaskPolicy(lease_s=args.lease_s)
    )
    workers.start()
    try:
        if not workers.wait_ready(60.0):
            _say("NOT READY")
            return 1
        _say("READY " + json.dumps(workers.pids))
        while not stop.wait(0.5):
            if workers.alive() == 0:
                break
    finally:
        codes = workers.stop()
    _say("EXITCODES " + json.dumps(codes))
    return 0 if all(code == 0 for code in codes) else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return drain(args) if args.mode == "drain" else pool(args)


if __name__ == "__main__":
    sys.exit(main())
