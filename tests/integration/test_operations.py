"""What an on-call engineer works from, end to end on a redis-server of the test's own: the
counters of ``/metrics`` while a worker is SIGKILLed mid-task, a request is published twice,
one is forged, one reuses an id with other content, a handler fails and a receiver dies
between its commit and its XACK (a lost acknowledgement); ``/readyz`` while Redis is away;
and the run's whole JSON log: one line per task transition, the failure's traceback, and
neither the keyring's secret nor any payload's marker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import pytest

from tests.integration.test_metrics import DEADLINE, _get, _keyring, _wait_counts
from tests.support.cli import cli_env, count_rows, publish, wait_for
from tests.support.redis_server import RedisServer, free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
HANDLER = "tests.support.handlers:held_or_failing"
SECRET = "alice-secret: the operations test's key, 32 bytes or more"
MARKER = "payload-marker-5e1d9"  # in every payload; never in a log
N = 4  # plain tasks


def _start(log: IO[str], *args: str, **env: str) -> subprocess.Popen[str]:
    """The CLI with its whole output in ``log`` (a pipe could fill and stall it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "broker_adapter", *args],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(**env),
    )


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of a ``--log-format json`` log, each one an object."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_counters_health_and_log_of_a_troubled_run(
    fresh_redis: RedisServer, tmp_path: Path, prefix: str
) -> None:
    url = fresh_redis.url
    keyring = _keyring(tmp_path / "keyring.json", SECRET)
    forger = _keyring(tmp_path / "forged.json", "not alice's secret, but 32 bytes long")
    db, rdb, hold = tmp_path / "adapter.db", tmp_path / "receiver.db", tmp_path / "held.pid"
    run_log = tmp_path / "run.log"
    port = free_port()
    with run_log.open("w") as out:
        run = _start(
            out,
            "-v",
            "run",
            "--redis",
            url,
            "--db",
            str(db),
            "--handler",
            HANDLER,
            "--workers",
            "2",
            "--keyring",
            str(keyring),
            "--prefix",
            prefix,
            "--lease",
            "5",
            "--metrics-port",
            str(port),
            "--log-format",
            "json",
        )

    def send(message_id: str, payload: dict[str, Any], keys: Path = keyring) -> None:
        """Publish ``payload`` with the marker, at the one deadline (a resend: a duplicate)."""
        publish(url, keys, prefix, message_id, {**payload, "m": MARKER}, deadline=DEADLINE)

    try:
        # A worker takes the held task and is SIGKILLed in its handler: its lease runs
        # out, the task runs again elsewhere (attempt 2) and is done.
        send("held", {"hold": str(hold)})
        wait_for(hold.exists, "the held task's handler running")
        os.kill(int(hold.read_text()), signal.SIGKILL)
        for i in range(N):
            send(f"m{i}", {"i": i})
        send("m0", {"i": 0})  # a duplicate
        send("m1", {"i": "other"})  # a conflict
        send("m9", {"i": 9}, forger)  # a bad signature
        send("bad", {"fail": True})  # handler raises
        stored = N + 2  # held, m0..m3, bad
        want = {
            'ba_stream_entries_read_total{stage="ingest"}': stored + 3,
            'ba_stream_entries_acked_total{stage="ingest"}': stored + 2,
            'ba_stream_dead_letters_total{reason="bad_signature",stage="ingest"}': 1,
            'ba_inbox_entries_total{outcome="stored"}': stored,
            'ba_inbox_entries_total{outcome="duplicate"}': 1,
            'ba_inbox_entries_total{outcome="conflict"}': 1,
            'ba_tasks{state="done"}': N + 1,
            'ba_tasks{state="failed"}': 1,
            'ba_tasks{state="running"}': 0,
            'ba_tasks{state="pending"}': 0,
            # counted when each claim committed: the killed worker's attempt too
            "ba_task_attempts_total": stored + 1,
            'ba_task_outcomes_total{outcome="done"}': N + 1,
            'ba_task_outcomes_total{outcome="failed"}': 1,
            'ba_task_outcomes_total{outcome="retry"}': 0,
            "ba_lease_takeovers_total": 1,
            "ba_stale_fence_refusals_total": 0,
            f'ba_handler_duration_seconds_count{{handler="{HANDLER}",task=""}}': stored,
            'ba_outbox_replies{state="sent"}': stored + 1,  # and the conflict's answer
            'ba_outbox_replies{state="dead"}': 0,
            "ba_outbox_oldest_unsent_age_seconds": 0,
            "ba_ready": 1,
        }
        got = _wait_counts(port, want, "the adapter's counters")
        published = sum(
            v
            for k, v in got.items()
            if k.startswith("ba_reply_publish_total") and 'outcome="published"' in k
        )
        assert published == stored + 1
        _receive_with_a_lost_ack(fresh_redis, rdb, keyring, prefix, tmp_path, stored + 1)
        # Redis away: not ready, alive all the same; back: ready again.
        wait_for(lambda: _get(port, "/readyz") == (200, "ready\n"), "ready")
        fresh_redis.kill()
        wait_for(lambda: _get(port, "/readyz")[0] == 503, "unready while Redis is down")
        assert "redis" in _get(port, "/readyz")[1]
        assert _get(port, "/healthz") == (200, "ok\n")
        fresh_redis.restart()
        wait_for(lambda: _get(port, "/readyz") == (200, "ready\n"), "ready again")
    finally:
        _stop(run)
    _check_run_log(run_log, db)


def _receive_with_a_lost_ack(
    server: RedisServer, rdb: Path, keyring: Path, prefix: str, tmp: Path, replies: int
) -> None:
    """A receiver SIGKILLed after its first commit, before its XACK; the next one replays
    those entries from its own pending list and skips them as duplicates, as it skips a
    copy of a reply entry."""
    args = [
        "receive",
        "--redis",
        server.url,
        "--db",
        str(rdb),
        "--principal",
        "alice",
        "--prefix",
        prefix,
        "--keyring",
        str(keyring),
        "--log-format",
        "json",
    ]
    with (tmp / "receive-1.log").open("w") as out:
        first = _start(out, *args, BA_CRASHPOINT="receiver.after_commit")
    assert first.wait(timeout=60) == -signal.SIGKILL
    lost = count_rows(rdb, "SELECT COUNT(*) FROM receipts")  # applied, not acknowledged
    assert 1 <= lost <= replies
    client: Any = server.client()
    stream = f"{prefix}:{{out.alice}}:replies"
    (_, entry), *_ = client.xrange(stream, count=1)
    client.xadd(stream, entry)  # the same reply once more
    client.close()
    port = free_port()
    with (tmp / "receive-2.log").open("w") as out:
        second = _start(out, *args, "--metrics-port", str(port))
    try:
        want = {
            'ba_stream_entries_replayed_total{stage="receiver"}': lost,
            'ba_stream_entries_read_total{stage="receiver"}': replies - lost + 1,
            'ba_receiver_replies_total{outcome="applied"}': replies - lost,
            'ba_receiver_replies_total{outcome="duplicate"}': lost + 1,
            'ba_receiver_replies_total{outcome="conflict"}': 0,
            'ba_receiver_replies_total{outcome="bad"}': 0,
            "ba_receipts": replies,
        }
        _wait_counts(port, want, "the receiver's counters")
    finally:
        _stop(second)
    for name in ("receive-1.log", "receive-2.log"):
        text = (tmp / name).read_text()
        assert SECRET not in text
        assert MARKER not in text
        _json_lines(tmp / name)  # every line of receive's log is JSON too
    assert _json_lines(tmp / "receive-2.log")  # it logged (its metrics port at least)


def _check_run_log(path: Path, db: Path) -> None:
    text = path.read_text()
    assert SECRET not in text
    assert MARKER not in text
    lines = _json_lines(path)  # every line is JSON, the workers' forwarded ones too
    tasks = [x for x in lines if x["logger"] == "broker_adapter.tasks"]
    # a line made by the clock (a lease run out) knows the task, not its request
    task_of = {x["message_id"]: x["task_id"] for x in tasks if x["transition"] == "accepted"}
    by_task: dict[str, list[tuple[str, int | None]]] = {}
    for x in tasks:
        by_task.setdefault(x["task_id"], []).append((x["transition"], x.get("attempt")))
    moves = {mid: by_task[tid] for mid, tid in task_of.items()}
    assert moves["m2"] == [("accepted", None), ("claimed", 1), ("done", 1)]
    assert moves["m0"][-1] == ("duplicate", None)
    assert ("conflict", None) in moves["m1"]
    assert len(task_of) == N + 2
    assert moves["held"] == [
        ("accepted", None),
        ("claimed", 1),
        ("lease_expired", 1),
        ("claimed", 2),
        ("done", 2),
    ]
    assert moves["bad"] == [("accepted", None), ("claimed", 1), ("failed", 1)]
    (failure,) = [x for x in lines if x["level"] == "ERROR" and x.get("message_id") == "bad"]
    assert "Traceback (most recent call last)" in failure["exc"]
    assert "ValueError: this task asks to fail" in failure["exc"]
    assert count_rows(db, "SELECT COUNT(*) FROM tasks WHERE state = 'failed'") == 1
    done = next(x for x in lines if x.get("transition") == "done" and x["message_id"] == "m2")
    for name in ("task_id", "principal", "reply_id", "owner", "fence", "state", "duration_s"):
        assert name in done, name
