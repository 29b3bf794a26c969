"""What both peer drivers share: the payload, the worker process, waiting for results,
medians and the one JSON line they print. Standard library and redis-py only (this runs in
``bench/.venv-peers``, where broker_adapter is not installed)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import redis

HERE = Path(__file__).resolve().parent
WARMUP = 200


def parse(doc: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--redis", required=True)
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--task", default="echo", help="echo, or nap (an async 50 ms wait)")
    parser.add_argument("--max-async-tasks", type=int, default=None,
                        help="taskiq: tasks each worker process runs at once")  # fmt: skip
    return parser.parse_args()


def payload(i: int) -> dict[str, Any]:
    """The same payload as bench/run.py's envelopes, with its publish time ``t``."""
    return {"action": "summarise", "doc": f"doc-{i}", "words": 400, "lang": "en", "i": i,
            "t": time.time()}  # fmt: skip


def start_worker(cmd: list[str], url: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PEER_REDIS_URL=url, PYTHONPATH=str(HERE))
    return subprocess.Popen(cmd, cwd=HERE, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the worker's process group (it forks its own children), then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def wait_keys(client: redis.Redis, keys: Iterable[str], timeout_s: float,
              proc: subprocess.Popen[bytes]) -> None:  # fmt: skip
    """Wait until every key exists (a result the peer's backend stored)."""
    todo = list(keys)
    deadline = time.monotonic() + timeout_s
    while todo:
        if time.monotonic() > deadline:
            raise SystemExit(f"{len(todo)} results missing after {timeout_s:.0f} s")
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
            raise SystemExit(f"the worker exited ({proc.returncode}): {err}")
        pipe = client.pipeline(transaction=False)
        for k in todo:
            pipe.exists(k)
        todo = [k for k, found in zip(todo, pipe.execute(), strict=True) if not found]
        if todo:
            time.sleep(0.05)  # polling the result keys, with a deadline


def report(name: str, args: argparse.Namespace, rates: list[float], extra: dict[str, Any]) -> None:
    out = {"peer": name, "n": args.n, "reps": args.reps, "workers": args.workers,
           "rates": rates, "median": statistics.median(rates), **extra}  # fmt: skip
    print(json.dumps(out), flush=True)
