"""Celery + Redis broker (``task_acks_late=True``) and Redis result backend: the trivial
echo workload through a prefork worker with ``--concurrency`` ``--workers``, timed like
bench/run.py: from the first publish to the last task run.

The client publishes with ``apply_async`` one at a time (Celery's ordinary call). Prints
one JSON line with the rates. Runs in ``bench/.venv-peers``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from importlib.metadata import version

import common_peer as cp
import redis

ARGS = cp.parse(__doc__ or "")
os.environ["PEER_REDIS_URL"] = ARGS.redis

from celery_app import app, echo  # noqa: E402  (reads PEER_REDIS_URL)

META = "celery-task-meta-"


def publish(count: int, tag: str) -> list[str]:
    return [META + echo.apply_async(args=[cp.payload(i)]).id for i in range(count)]


def collect(client: redis.Redis, keys: list[str]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo in range(0, len(keys), 1000):
        for raw in client.mget(keys[lo : lo + 1000]):
            meta = json.loads(raw)
            if meta["status"] != "SUCCESS":
                raise SystemExit(f"a task did not succeed: {meta}")
            out.append((meta["result"]["echo"]["t"], meta["result"]["done"]))
    return out


def main() -> int:
    client = redis.Redis.from_url(ARGS.redis)
    rates: list[float] = []
    for rep in range(ARGS.reps):
        client.flushall()
        proc = cp.start_worker(
            [sys.executable, "-m", "celery", "-A", "celery_app", "worker", "--pool", "prefork",
             "--concurrency", str(ARGS.workers), "--loglevel", "WARNING", "--without-gossip",
             "--without-mingle", "--without-heartbeat"],
            ARGS.redis,
        )  # fmt: skip
        try:
            warm = publish(cp.WARMUP, "w")
            cp.wait_keys(client, warm, 300, proc)
            keys = publish(ARGS.n, "m")
            cp.wait_keys(client, keys, max(300.0, ARGS.n / 20), proc)
            times = collect(client, keys)
            rates.append(ARGS.n / (max(d for _, d in times) - min(t for t, _ in times)))
        finally:
            cp.stop_worker(proc)
        print(f"celery rep {rep + 1}: {rates[-1]:,.0f} msgs/s", file=sys.stderr, flush=True)
    app.close()
    cp.report("celery", ARGS, rates, {
        "versions": {p: version(p) for p in ("celery", "kombu", "redis")},
        "config": f"Redis broker + Redis result backend, task_acks_late=True, prefork "
                  f"--concurrency {ARGS.workers}, JSON",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
