"""taskiq + taskiq-redis ``RedisStreamBroker``: the trivial echo workload through ``--workers``
worker processes (``taskiq worker``, default ack type ``when_saved``: XACK after the result
is stored), timed like bench/run.py: from the first publish to the last task run.

The client publishes with ``kiq`` 100 at a time (``asyncio.gather``: taskiq has no batch
publish). Prints one JSON line with the rates. Runs in ``bench/.venv-peers``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from importlib.metadata import version

import common_peer as cp
import redis

ARGS = cp.parse(__doc__ or "")
os.environ["PEER_REDIS_URL"] = ARGS.redis

from taskiq_app import broker, echo, nap  # noqa: E402  (reads PEER_REDIS_URL)

TASK = nap if ARGS.task == "nap" else echo


async def publish(count: int, tag: str) -> list[str]:
    ids: list[str] = []
    for lo in range(0, count, 100):
        sent = await asyncio.gather(
            *(TASK.kiq(cp.payload(i)) for i in range(lo, min(lo + 100, count)))
        )
        ids += [t.task_id for t in sent]
    return ids


async def collect(ids: list[str]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    backend = broker.result_backend
    for lo in range(0, len(ids), 500):
        results = await asyncio.gather(*(backend.get_result(i) for i in ids[lo : lo + 500]))
        for r in results:
            if r.is_err:
                raise SystemExit(f"a task failed: {r.error}")
            value = r.return_value
            out.append((value["echo"]["t"], value["done"]))
    return out


async def one_rep(client: redis.Redis, proc: cp.subprocess.Popen[bytes], n: int) -> float:
    warm = await publish(cp.WARMUP, "w")
    cp.wait_keys(client, warm, 300, proc)
    ids = await publish(n, "m")
    cp.wait_keys(client, ids, max(300.0, n / 50), proc)
    times = await collect(ids)
    return n / (max(d for _, d in times) - min(t for t, _ in times))


async def run_all() -> list[float]:
    """Every repetition on ONE event loop, with one client ``startup``: the broker's and
    the backend's connection pools are bound to the loop that first used them."""
    client = redis.Redis.from_url(ARGS.redis)
    rates: list[float] = []
    await broker.startup()
    try:
        for rep in range(ARGS.reps):
            client.flushall()
            proc = cp.start_worker(
                [sys.executable, "-m", "taskiq", "worker", "taskiq_app:broker",
                 "--workers", str(ARGS.workers), "--log-level", "WARNING",
                 *(["--max-async-tasks", str(ARGS.max_async_tasks)]
                   if ARGS.max_async_tasks else [])],
                ARGS.redis,
            )  # fmt: skip
            try:
                rates.append(await one_rep(client, proc, ARGS.n))
            finally:
                cp.stop_worker(proc)
            print(f"taskiq rep {rep + 1}: {rates[-1]:,.0f} msgs/s", file=sys.stderr, flush=True)
    finally:
        await broker.shutdown()
    return rates


def main() -> int:
    rates = asyncio.run(run_all())
    cp.report("taskiq", ARGS, rates, {
        "versions": {p: version(p) for p in ("taskiq", "taskiq-redis", "redis")},
        "config": "RedisStreamBroker + RedisAsyncResultBackend, ack when_saved, "
                  f"{ARGS.workers} worker processes, async task {ARGS.task}"
                  + (f", --max-async-tasks {ARGS.max_async_tasks}"
                     if ARGS.max_async_tasks else ""),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
