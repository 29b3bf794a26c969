"""A worker process of ``run --app --concurrency 8`` SIGKILLed with 8 tasks in flight: none
is lost, none runs twice beyond the at-least-once rules (a call the kill cut short runs
again, once), and the task whose declared effect had started goes to ``unknown`` and its
reconcile instead of a second call."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from broker_adapter.client.publisher import Publisher
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import connect
from tests.integration.test_router_run import _rows, _sent
from tests.support.cli import cli_env, wait_for
from tests.support.ingest_script import real_deadline, write_keyring
from tests.support.redis_server import RedisServer
from tests.support.router_app import calls

pytestmark = pytest.mark.crash

ROOT = Path(__file__).resolve().parents[2]


def test_a_worker_killed_with_eight_tasks_in_flight_loses_none_and_doubles_none(
    redis_server: RedisServer, tmp_path: Path, prefix: str
) -> None:
    keyring_path = tmp_path / "keyring.json"
    keyring = write_keyring(keyring_path)
    db, calls_file, log = tmp_path / "adapter.db", tmp_path / "calls.jsonl", tmp_path / "run.log"
    with log.open("w") as out:
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "broker_adapter",
                "run",
                "--redis",
                redis_server.url,
                "--db",
                str(db),
                "--app",
                "tests.support.router_app:router",
                "--workers",
                "1",
                "--concurrency",
                "8",
                "--lease",
                "2",
                "--claim-min-idle-ms",
                "1000",
                "--keyring",
                str(keyring_path),
                "--prefix",
                prefix,
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env=cli_env(BA_TEST_CALLS=str(calls_file)),
        )
    try:
        publisher = Publisher(connect(redis_server.url), Keys(prefix), "alice", keyring)
        for i in range(8):
            task = "charge" if i == 0 else "nap"
            publisher.publish(
                Envelope.build(
                    message_id=f"k{i}",
                    sender="alice",
                    task=task,
                    deadline=real_deadline(),
                    payload={"seconds": 60, "later_s": 0},
                )
            )

        def started() -> list[dict[str, object]]:
            return [c for c in calls(calls_file) if c["what"] == "start"]

        wait_for(lambda: len(started()) == 8, "8 calls in flight in one worker", 60)
        (pid,) = {int(str(c["pid"])) for c in started()}
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: _sent(db, "k%") == 8, "8 replies after the kill", 90)
    finally:
        run.send_signal(signal.SIGTERM)
        code = run.wait(timeout=60)
    assert code == 0, log.read_text()
    rows = {
        r["message_id"]: r
        for r in _rows(db, "SELECT message_id, state, attempts, result FROM tasks")
    }
    assert {m: r["state"] for m, r in rows.items()} == {f"k{i}": "done" for i in range(8)}
    seen = calls(calls_file)
    # The charge's effect had started: reconciled, never called again.
    assert [c["what"] for c in seen if c["message_id"] == "k0"] == ["start"]
    assert json.loads(rows["k0"]["result"]) == {"charged": True, "seen_by": "reconcile"}
    # The others: cut short once, run again once, ended once.
    for i in range(1, 8):
        mine = [(c["what"], c["attempt"]) for c in seen if c["message_id"] == f"k{i}"]
        assert sorted(mine) == [("end", 2), ("start", 1), ("start", 2)], (i, mine)
        assert rows[f"k{i}"]["attempts"] == 2
