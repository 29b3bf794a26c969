"""``run --metrics-port`` and ``receive --metrics-port`` end to end: the CLI in subprocesses
on a redis-server of the test's own; each counter moves by exactly what the test did, and
``/readyz`` follows Redis going away and coming back."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import cli_env, publish, publish_range, wait_for
from tests.support.redis_server import RedisServer, free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
HANDLER = "broker_adapter.examples:echo"
SECRET = "alice-secret: a test key of 32 bytes or more"


def _keyring(path: Path, secret: str) -> Path:
    path.write_text(json.dumps({"alice": {"k1": secret}}))
    path.chmod(0o600)
    return path


#: The deadline of every request the tests publish: a resend is the same request.
DEADLINE = time.time() + 3600


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "broker_adapter", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(),
    )


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return out


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:  # not listening yet
        return 0, str(exc)


def scrape(port: int) -> dict[str, float]:
    """``/metrics`` as ``{'name{label="v",...}': value}`` (labels as exported, sorted)."""
    status, body = _get(port, "/metrics")
    if status != 200:
        return {}
    values: dict[str, float] = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def _wait_counts(port: int, want: dict[str, int], what: str) -> dict[str, float]:
    """Scrape until every sample of ``want`` has its value; fail showing got and wanted."""
    got: dict[str, float] = {}

    def matches() -> bool:
        got.clear()
        got.update(scrape(port))
        return all(got.get(k) == v for k, v in want.items())

    try:
        wait_for(matches, what)
    except AssertionError:
        raise AssertionError({k: (got.get(k), v) for k, v in want.items()}) from None
    return got


def test_metrics_count_what_happened_and_readyz_follows_redis(
    fresh_redis: RedisServer, tmp_path: Path, prefix: str
) -> None:
    url = fresh_redis.url
    keyring = _keyring(tmp_path / "keyring.json", SECRET)
    forger = _keyring(tmp_path / "forged.json", "not alice's secret, but 32 bytes long")
    n = 5
    publish_range(url, keyring, prefix, range(n), deadline=DEADLINE)
    publish(url, keyring, prefix, "m0", {"i": 0}, deadline=DEADLINE)  # again: a duplicate
    publish(url, keyring, prefix, "m1", {"i": "other"}, deadline=DEADLINE)  # a conflict
    publish(url, forger, prefix, "m9", {"i": 9}, deadline=DEADLINE)  # a bad secret
    db, rdb = tmp_path / "adapter.db", tmp_path / "receiver.db"
    port = free_port()
    run = _start(
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
        "--metrics-port",
        str(port),
    )
    try:
        inbound = f'stream="{prefix}:{{in}}:tasks"'
        want = {
            'ba_stream_entries_read_total{stage="ingest"}': n + 3,
            'ba_inbox_entries_total{outcome="stored"}': n,
            'ba_inbox_entries_total{outcome="duplicate"}': 1,
            'ba_inbox_entries_total{outcome="conflict"}': 1,
            'ba_inbox_entries_total{outcome="expired"}': 0,
            'ba_inbox_entries_total{outcome="hop_limit"}': 0,
            'ba_stream_dead_letters_total{reason="bad_signature",stage="ingest"}': 1,
            'ba_stream_entries_acked_total{stage="ingest"}': n + 2,
            'ba_tasks{state="done"}': n,
            'ba_tasks{state="pending"}': 0,
            "ba_task_attempts_total": n,
            'ba_task_outcomes_total{outcome="done"}': n,
            "ba_stale_fence_refusals_total": 0,
            "ba_lease_takeovers_total": 0,
            f'ba_handler_duration_seconds_count{{handler="{HANDLER}",task=""}}': n,
            # n answers and the conflict's answer, all sent: nothing unsent, nothing dead
            'ba_outbox_replies{state="sent"}': n + 1,
            'ba_outbox_replies{state="dead"}': 0,
            "ba_outbox_oldest_unsent_age_seconds": 0,
            f'ba_stream_group_pending{{group="ba-ingest",{inbound}}}': 0,
            f'ba_stream_group_lag{{group="ba-ingest",{inbound}}}': 0,
            'ba_redis_data_loss_alarms_total{kind="wipe",stage="dispatcher"}': 0,
            "ba_ready": 1,
        }
        got = _wait_counts(port, want, "the counters of what happened")
        published = sum(
            v
            for k, v in got.items()
            if k.startswith("ba_reply_publish_total") and 'outcome="published"' in k
        )
        assert published == n + 1, [(k, v) for k, v in got.items() if "publish" in k and v]
        assert _get(port, "/healthz") == (200, "ok\n")
        wait_for(lambda: _get(port, "/readyz") == (200, "ready\n"), "ready")
        fresh_redis.kill()
        wait_for(lambda: _get(port, "/readyz")[0] == 503, "unready while Redis is down")
        status, body = _get(port, "/readyz")
        assert status == 503
        assert "redis" in body
        assert _get(port, "/healthz")[0] == 200  # alive all the same
        fresh_redis.restart()  # same port, data kept (AOF always)
        wait_for(lambda: _get(port, "/readyz") == (200, "ready\n"), "ready again")
    finally:
        log = _stop(run)
    assert SECRET not in log
    _receive_counts(fresh_redis, rdb, keyring, prefix, n + 1)


def _receive_counts(server: RedisServer, rdb: Path, keyring: Path, prefix: str, n: int) -> None:
    """The receiver applies the ``n`` replies once each; a copy of one entry is counted as a
    duplicate skipped."""
    client: Any = server.client()
    replies = f"{prefix}:{{out.alice}}:replies"
    (_, first), *_ = client.xrange(replies, count=1)
    client.xadd(replies, first)  # the same reply (id, content, signature) once more
    client.close()
    port = free_port()
    rcv = _start(
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
        "--metrics-port",
        str(port),
    )
    try:
        want = {
            'ba_receiver_replies_total{outcome="applied"}': n,
            'ba_receiver_replies_total{outcome="duplicate"}': 1,
            'ba_receiver_replies_total{outcome="conflict"}': 0,
            'ba_receiver_replies_total{outcome="bad"}': 0,
            'ba_stream_entries_read_total{stage="receiver"}': n + 1,
            "ba_receipts": n,
        }
        _wait_counts(port, want, "the receiver's counters")
        wait_for(lambda: _get(port, "/readyz") == (200, "ready\n"), "receiver ready")
    finally:
        _stop(rcv)


def test_metrics_port_off_by_default_serves_nothing(tmp_path: Path) -> None:
    """Without ``--metrics-port`` the CLI never imports prometheus_client."""
    code = (
        "import sys, broker_adapter.app.cli, broker_adapter.app.adapter,"
        " broker_adapter.stages.worker.worker;"
        " print('prometheus_client' in sys.modules)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert res.stdout.strip() == "False", res.stderr
