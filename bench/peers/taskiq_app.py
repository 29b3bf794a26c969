"""The taskiq side of the peer benchmark: taskiq-redis ``RedisStreamBroker`` (consumer group,
XACK after the result is saved: taskiq's default ``--ack-type when_saved``) and the Redis
result backend. The task is the trivial echo; its result carries the time it ran."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from taskiq_redis import RedisAsyncResultBackend, RedisStreamBroker

URL = os.environ.get("PEER_REDIS_URL", "redis://127.0.0.1:6379/0")

broker = RedisStreamBroker(URL, queue_name="peer-bench", consumer_id="0").with_result_backend(
    RedisAsyncResultBackend(URL)
)


@broker.task(task_name="echo")
async def echo(payload: dict[str, Any]) -> dict[str, Any]:
    return {"echo": payload, "done": time.time()}


#: How long ``nap`` waits: the async-handler workload of bench/async_handlers.py.
NAP_S = 0.05


@broker.task(task_name="nap")
async def nap(payload: dict[str, Any]) -> dict[str, Any]:
    await asyncio.sleep(NAP_S)  # the workload: an async wait, as on a model or an API
    return {"echo": payload, "done": time.time()}
