"""The Celery side of the peer benchmark: Redis broker, Redis result backend,
``task_acks_late=True`` (the message is acknowledged after the task ran), JSON. The task is
the trivial echo; its result carries the time it ran."""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

URL = os.environ.get("PEER_REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery("peer_bench", broker=URL, backend=URL)
app.conf.update(
    task_acks_late=True,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(name="echo")
def echo(payload: dict[str, Any]) -> dict[str, Any]:
    return {"echo": payload, "done": time.time()}
