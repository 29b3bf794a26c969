"""Two adapters on one PostgreSQL database, one on a host whose clock runs a minute ahead
(libfaketime, Debian's ``faketime`` package, preloaded into its processes): leases are
judged by the server's clock, so it takes no lease early, nothing commits past a lease,
and every request runs once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from broker_adapter.client.publisher import Publisher
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect
from tests.support.cli import cli_env, wait_for
from tests.support.handlers import init_effects_db, ledger
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
#: Where Debian's libfaketime package puts the library (multi-threaded variant).
LIBFAKETIME = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/faketime/libfaketimeMT.so.1",
)
AHEAD_S = 60


def _libfaketime() -> str:
    found = next((p for p in LIBFAKETIME if Path(p).exists()), None)
    if found is None:
        pytest.skip("libfaketime is not installed (apt-get install faketime)")
    return found


def _ahead_env() -> dict[str, str]:
    """The environment of a process (and its children) whose clock runs ``AHEAD_S``
    seconds ahead; monotonic time left alone."""
    return cli_env(
        LD_PRELOAD=_libfaketime(), FAKETIME=f"+{AHEAD_S}s", FAKETIME_DONT_FAKE_MONOTONIC="1"
    )


def _count(url: str, sql: str) -> int:
    try:
        with psycopg.connect(url) as conn:
            row = conn.execute(sql).fetchone()
    except psycopg.errors.UndefinedTable:
        return 0
    return int(row[0]) if row and row[0] is not None else 0


def _status(url: str, env: dict[str, str]) -> dict[str, object]:
    res = subprocess.run(
        [sys.executable, "-m", "broker_adapter", "status", "--db", url, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    report: dict[str, object] = json.loads(res.stdout)
    return report


def test_a_host_a_minute_ahead_takes_no_lease_early_and_every_request_runs_once(
    redis_server: RedisServer, prefix: str, pg_url: str, tmp_path: Path
) -> None:
    env_ahead = _ahead_env()
    probe = subprocess.run(
        [sys.executable, "-c", "import time; print(time.time())"],
        capture_output=True,
        text=True,
        env=env_ahead,
        timeout=30,
    )
    assert float(probe.stdout) > time.time() + AHEAD_S - 5, "libfaketime did not take"
    keyring = tmp_path / "keyring.json"
    keyring.write_text(json.dumps({"alice": {"k1": "alice-secret: a test key of 32 bytes+"}}))
    keyring.chmod(0o600)
    effects_db = tmp_path / "effects.db"
    init_effects_db(effects_db)
    n = 16
    deadline = time.time() + 600
    publisher = Publisher(connect(redis_server.url), Keys(prefix), "alice", Keyring.load(keyring))
    for i in range(n):
        publisher.publish(
            Envelope.build(
                message_id=f"m{i}",
                sender="alice",
                deadline=deadline,
                max_attempts=3,
                payload={"effects_db": str(effects_db), "value": i, "hold_s": 1.0},
            )
        )

    def start(name: str, env: dict[str, str], log: Path) -> subprocess.Popen[str]:
        # A lease of 10 s (renewed every 10/3 s), far below the skew: each handler holds
        # its task for 1 s, so a host judging leases by its own clock a minute ahead would
        # see every lease of the other host's as run out, and take its tasks over.
        with log.open("w") as out:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "broker_adapter",
                    "run",
                    "--redis",
                    redis_server.url,
                    "--db",
                    pg_url,
                    "--handler",
                    "tests.support.handlers:held_record",
                    "--workers",
                    "2",
                    "--keyring",
                    str(keyring),
                    "--prefix",
                    prefix,
                    "--name",
                    name,
                    "--lease",
                    "10",
                    "--claim-min-idle-ms",
                    "1000",
                ],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=out,
                text=True,
                env=env,
            )

    on_time = start("on-time", cli_env(), tmp_path / "on-time.log")
    ahead = start("ahead", env_ahead, tmp_path / "ahead.log")
    try:
        wait_for(
            lambda: _count(pg_url, "SELECT count(*) FROM outbox WHERE state = 'sent'") == n,
            "every reply sent",
            timeout_s=180,
        )
    finally:
        for proc in (on_time, ahead):
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=60) for proc in (on_time, ahead)]
    assert codes == [0, 0]
    # Every request ran once: one call each in the target's ledger, under the first fence.
    calls = ledger(effects_db)
    assert sorted(key for key, _, _, _ in calls) == sorted({key for key, _, _, _ in calls})
    assert len(calls) == n
    assert {(fence, attempt) for _, fence, attempt, _ in calls} == {(1, 1)}
    # No lease taken early, no commit past one: every task done at its first claim, and no
    # worker's commit or renewal was refused.
    assert _count(pg_url, "SELECT count(*) FROM tasks WHERE state = 'done' AND fence = 1") == n
    assert _count(pg_url, "SELECT max(attempts) FROM tasks") == 1
    owners = {owner for _, _, _, owner in calls}
    assert any("ahead" in o for o in owners), owners  # the skewed host did its share
    assert any("on-time" in o for o in owners), owners
    logs = {p.stem: p.read_text() for p in (tmp_path / "ahead.log", tmp_path / "on-time.log")}
    for text in logs.values():
        assert "lease lost" not in text, text[-2000:]
        assert "stale" not in text.lower(), text[-2000:]
    # The skew is measured and reported: the ahead host's start-up warning and ``status``.
    assert "clock is +6" in logs["ahead"], logs["ahead"][-2000:]
    assert "clock is" not in logs["on-time"]
    skew_ahead = _status(pg_url, env_ahead)["clock"]
    skew_on_time = _status(pg_url, cli_env())["clock"]
    assert isinstance(skew_ahead, dict)
    assert isinstance(skew_on_time, dict)
    assert skew_ahead["source"] == skew_on_time["source"] == "database server"
    assert abs(skew_ahead["skew_s"] - AHEAD_S) < 5
    assert abs(skew_on_time["skew_s"]) < 5
