"""The async-handler workload of ``bench/async_handlers.py``: one task, the default, that
waits ``NAP_S`` the way a call to a model or an API does (an ``await``, no CPU)."""

from __future__ import annotations

import asyncio
from typing import Any

from broker_adapter import Router, Task

#: How long each call waits, seconds.
NAP_S = 0.05

router = Router()


@router.task("nap", default=True)
async def nap(task: Task) -> dict[str, Any]:
    """Wait ``NAP_S``, as a call to an API would."""
    await asyncio.sleep(NAP_S)
    return {"i": task.payload.get("i")}
