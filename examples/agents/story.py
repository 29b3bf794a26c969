"""Two agents delegate work to each other through broker_adapter, and one is killed.

The planner asks the ops agent to restart ``web`` (``Client.request``); the ops agent asks
the planner to confirm, restarts the service, and is SIGKILLed before it can commit its
answer. Its adapter comes back, the task runs again under a new fence, finds the restart
already done under its idempotency key, and answers. The planner gets one reply; the world
saw one restart. Run it: ``python examples/agents/story.py`` (needs redis-server).
"""

from __future__ import annotations

import os
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path

from broker_adapter.testing import RedisServer, RunningAdapter, write_keyring

HERE = Path(__file__).resolve().parent


def main() -> int:
    sys.path.insert(0, str(HERE))
    from planner import ask_for_restart

    with tempfile.TemporaryDirectory(prefix="agents-") as tmp, RedisServer() as redis:
        work = Path(tmp)
        keyring = work / "keyring.json"
        write_keyring(keyring, ["planner", "ops"])
        steps = work / "steps"
        steps.mkdir()
        os.environ.update(AGENTS_REDIS=redis.url, AGENTS_KEYRING=str(keyring),
                          AGENTS_WORLD=str(work / "world.db"), AGENTS_STEPS=str(steps))  # fmt: skip

        def adapter(name: str) -> RunningAdapter:
            return RunningAdapter(
                redis_url=redis.url, db=work / f"{name}.db", keyring=keyring, prefix=name,
                target=("--app", f"{name}:router"), app_dir=HERE,
                extra_args=["--workers", "1", "--lease", "2", "--name", name],
            )  # fmt: skip

        planner, ops = adapter("planner").start(), adapter("ops").start()
        answer: dict[str, object] = {}
        asking = threading.Thread(target=lambda: answer.update(ask_for_restart("web")))
        asking.start()
        print("planner -> ops: restart web (ops asks the planner to confirm)")
        while not (steps / "restarted-attempt-1").exists():
            time.sleep(0.05)  # waiting for the ops agent's handler, another process
        print("ops restarted web; killing the ops agent before it commits its answer")
        ops.kill()
        ops = adapter("ops").start()
        print("ops agent restarted; its task runs again under a new fence")
        asking.join(timeout=120)
        planner.stop()
        ops.stop()
        with sqlite3.connect(work / "world.db") as world:
            restarts = world.execute("SELECT COUNT(*) FROM restarts").fetchone()[0]
        attempts = sorted(p.name for p in steps.iterdir())
    print(f"planner got: {answer}")
    print(f"handler attempts that reached the effect: {attempts}")
    print(f"restarts the world saw: {restarts}")
    ok = answer.get("restarted") is True and restarts == 1 and len(attempts) == 2
    print("exactly one effect" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
