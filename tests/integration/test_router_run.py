"""``broker-adapter run --app`` end to end: a real redis-server, the CLI and its worker
processes as real subprocesses, a Router of named tasks (``tests.support.router_app``)."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.client.publisher import Publisher
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import connect
from tests.support.cli import cli_env, wait_for
from tests.support.ingest_script import real_deadline, write_keyring
from tests.support.redis_server import RedisServer
from tests.support.router_app import calls

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.support.router_app:router"


def _rows(db: Path, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
    if not db.exists():
        return []
    conn = sqlite3.connect(db, timeout=10)
    conn.row_factory = sqlite3.Row
    try:
        return conn.execute(sql, params).fetchall()
    except sqlite3.OperationalError:
        return []
    finally:
        conn.close()


def _sent(db: Path, like: str) -> int:
    """Tasks of message ids ``LIKE like`` that are terminal with their reply published."""
    rows = _rows(
        db,
        "SELECT count(*) FROM tasks t JOIN outbox o ON o.task_id = t.task_id"
        " WHERE t.message_id LIKE ? AND o.state = 'sent'",
        (like,),
    )
    return int(rows[0][0]) if rows else 0


@pytest.fixture
def adapter(
    redis_server: RedisServer, tmp_path: Path, prefix: str
) -> Iterator[tuple[Publisher, Path, Path]]:
    """``run --app`` with 2 workers of 8 lanes; yields a publisher, the database and the
    calls file."""
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
                APP,
                "--workers",
                "2",
                "--concurrency",
                "8",
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
    publisher = Publisher(connect(redis_server.url), Keys(prefix), "alice", keyring)
    try:
        yield publisher, db, calls_file
    finally:
        run.send_signal(signal.SIGTERM)
        code = run.wait(timeout=60)
        assert code == 0, log.read_text()


def _send(publisher: Publisher, message_id: str, task: str | None, payload: dict[str, Any]) -> None:
    fields: dict[str, Any] = {"task": task} if task else {}
    publisher.publish(
        Envelope.build(
            message_id=message_id,
            sender="alice",
            payload=payload,
            deadline=real_deadline(),
            **fields,
        )
    )


def test_sixteen_async_calls_of_one_second_finish_in_under_three_seconds(
    adapter: tuple[Publisher, Path, Path],
) -> None:
    publisher, db, calls_file = adapter
    _send(publisher, "warm", "nap", {"seconds": 0})
    wait_for(lambda: _sent(db, "warm") == 1, "the adapter up and serving", 60)
    started = time.monotonic()
    for i in range(16):
        _send(publisher, f"fast-{i}", "nap" if i % 2 else None, {"seconds": 1.0})
    wait_for(lambda: _sent(db, "fast-%") == 16, "16 replies", 30)
    elapsed = time.monotonic() - started
    assert elapsed < 3.0, f"16 calls of 1 s took {elapsed:.2f} s end to end"
    ran = [c for c in calls(calls_file) if c["message_id"].startswith("fast-")]
    assert len([c for c in ran if c["what"] == "end"]) == 16
    # each called once, the two worker processes sharing them (a lease lost by one call
    # stops only that one: tests/unit/test_router.py)
    assert len({c["message_id"] for c in ran if c["what"] == "start"}) == 16
    assert len({c["pid"] for c in ran}) == 2
    done = _rows(db, "SELECT state, attempts FROM tasks WHERE message_id LIKE 'fast-%'")
    assert {(r["state"], r["attempts"]) for r in done} == {("done", 1)}


def test_two_names_and_the_refused_ones_end_to_end(adapter: tuple[Publisher, Path, Path]) -> None:
    publisher, db, calls_file = adapter
    _send(publisher, "g1", "greet", {"name": "ada", "times": 2})
    _send(publisher, "n1", "nap", {"seconds": 0.01})
    _send(publisher, "u1", "reboot", {"name": "ada"})
    _send(publisher, "i1", "greet", {"name": "", "times": 9})
    wait_for(lambda: _sent(db, "%1") == 4, "4 replies", 60)
    rows = {
        r["message_id"]: r
        for r in _rows(
            db, "SELECT message_id, state, attempts, result, error, task_name FROM tasks"
        )
    }
    assert json.loads(rows["g1"]["result"]) == {"text": "hello ada hello ada"}
    assert rows["g1"]["task_name"] == "greet"
    assert json.loads(rows["n1"]["result"])["slept"] == 0.01
    assert (rows["u1"]["state"], rows["u1"]["attempts"]) == ("failed", 1)
    assert "unknown task 'reboot'" in rows["u1"]["error"]
    assert (rows["i1"]["state"], rows["i1"]["attempts"]) == ("failed", 1)
    assert "name" in rows["i1"]["error"]
    assert "times" in rows["i1"]["error"]
    called = {c["message_id"] for c in calls(calls_file)}
    assert {"g1", "n1"} <= called
    assert not {"u1", "i1"} & called  # no handler ran for the refused two


def test_schema_prints_each_tasks_payload_and_result() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "broker_adapter", "schema", "--app", APP],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
    )
    assert res.returncode == 0, res.stderr
    tasks = {t["name"]: t for t in json.loads(res.stdout)["tasks"]}
    assert set(tasks) == {"nap", "greet", "charge"}
    assert tasks["greet"]["payload"]["required"] == ["name"]
    assert tasks["greet"]["result"]["properties"] == {"text": {"title": "Text", "type": "string"}}
    assert tasks["nap"]["default"] is True
    assert tasks["nap"]["description"].startswith("Sleep")
    bad = subprocess.run(
        [sys.executable, "-m", "broker_adapter", "schema", "--app", "tests.support.nothing:router"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
    )
    assert bad.returncode == 2
    assert "not found" in bad.stderr
