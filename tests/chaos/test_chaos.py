"""The chaos acceptance runs, each through ``python -m tests.chaos.run`` as a subprocess.

* the short profile (durable Redis, fixed seed) must come out valid: nothing lost, nothing
  doubled, no stale commit, a clean end, under a few dozen faults of every package;
* the same short profile on a local Redis Cluster (three masters, AOF always, inbound
  partitions on every master) with the two adapters, standing in for two hosts, sharing a
  throwaway PostgreSQL database, must come out valid too, both adapters having done work;
* each planted bug must make the checker fail with the anomaly it causes, and the same
  scripted scenario without the bug must pass (so the failure is the bug's, not the
  scenario's).

These tests run in the default ``pytest`` run as well as in ``make chaos``. A run is real
time (real leases, real kills); the seed fixes the plan and the fault schedule.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.postgres import ENV_SERVER, require_server
from tests.support.redis_cluster import require_cluster
from tests.support.redis_server import require_binary

pytestmark = pytest.mark.chaos

ROOT = Path(__file__).resolve().parents[2]
SHORT_SEED = 20251129
SHORT_BUDGET_S = 180.0
PLANTED_SEED = 7
CLUSTER_PG_SEED = 20251201
CLUSTER_PG_BUDGET_S = 210.0


def _chaos(out: Path, *args: str, timeout_s: float) -> tuple[int, dict[str, Any], str]:
    """Run one chaos run; returns its exit code, its ``result.json`` and its output."""
    require_binary()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BA_", "CHAOS_"))}
    if ENV_SERVER in os.environ:  # the PostgreSQL server a --store postgresql run uses
        env[ENV_SERVER] = os.environ[ENV_SERVER]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.chaos.run", "--out", str(out), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:  # timed out (or the test was interrupted): clean up first
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    result_path = out / "result.json"
    assert result_path.exists(), f"no result.json; output:\n{output[-4000:]}"
    return proc.returncode, json.loads(result_path.read_text()), output


@pytest.mark.timeout(300)
def test_chaos_short_profile_loses_nothing_and_doubles_nothing(tmp_path: Path) -> None:
    started = time.monotonic()
    code, result, output = _chaos(
        tmp_path / "short", "--profile", "short", "--seed", str(SHORT_SEED), timeout_s=280
    )
    elapsed = time.monotonic() - started
    check = result["check"]
    assert check["valid"], output[-6000:]
    assert code == 0, output[-6000:]
    info = check["info"]
    faults = info["faults_by_kind"]
    assert sum(faults.values()) >= 24, faults
    for kind in (
        "kill-adapter",
        "crashpoint",
        "pause-adapter",
        "redis-kill",
        "storm",
        "forge-reply",
        "poison-reply",
        "replay",
    ):
        assert faults.get(kind, 0) >= 1, f"no {kind} fault in {faults}"
    hostile = info["hostile"]  # every planted reply entry dead-lettered, none applied
    assert hostile["forgeries"] > 0, hostile
    assert hostile["replays_acked"] > 0, hostile
    assert info["publishes"]["acked"] >= 150, info["publishes"]
    # acknowledged bad input missing from the DLQ is a violation already; here: some arrived
    assert info["rejected"]["in_dlq"] > 0, info["rejected"]
    assert info["tasks_by_state"].get("done", 0) >= 100, info["tasks_by_state"]
    assert elapsed <= SHORT_BUDGET_S, f"the short profile took {elapsed:.0f} s"


@pytest.mark.timeout(300)
def test_chaos_short_profile_on_cluster_and_postgresql_with_two_hosts_stays_valid(
    tmp_path: Path,
) -> None:
    require_cluster(tmp_path / "probe")
    require_server()
    started = time.monotonic()
    code, result, output = _chaos(
        tmp_path / "cluster-pg",
        "--profile",
        "short",
        "--seed",
        str(CLUSTER_PG_SEED),
        "--topology",
        "cluster",
        "--store",
        "postgresql",
        timeout_s=280,
    )
    elapsed = time.monotonic() - started
    check = result["check"]
    assert check["valid"], output[-6000:]
    assert code == 0, output[-6000:]
    assert (result["topology"], result["store"]) == ("cluster", "postgresql")
    assert result["partitions"] > 1
    info = check["info"]
    faults = info["faults_by_kind"]
    assert sum(faults.values()) >= 24, faults
    for kind in (
        "kill-adapter",
        "crashpoint",
        "pause-adapter",
        "master-kill",
        "client-kill",
        "pg-terminate",
        "storm",
        "forge-reply",
        "poison-reply",
    ):
        assert faults.get(kind, 0) >= 1, f"no {kind} fault in {faults}"
    for kind in ("net-reset", "redis-kill", "sqlite-busy"):  # the proxy's, one server's, SQLite's
        assert kind not in faults, faults
    assert info["hostile"]["forgeries"] > 0, info["hostile"]
    assert info["publishes"]["acked"] >= 150, info["publishes"]
    assert info["rejected"]["in_dlq"] > 0, info["rejected"]
    assert info["tasks_by_state"].get("done", 0) >= 100, info["tasks_by_state"]
    work = result["work_by_adapter"]  # both "hosts" ran handlers to their effect
    assert set(work) == {"a1", "a2"}, work
    assert min(work.values()) >= 10, work
    assert elapsed <= CLUSTER_PG_BUDGET_S, f"the cluster + PostgreSQL run took {elapsed:.0f} s"


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("bug", "scenario", "anomaly"),
    [
        ("xack_before_commit", "ingest-crash", "lost"),
        ("stale_finish", "zombie", "stale_commit"),
        ("skip_reply_signature", "forged-reply", "forged_reply_applied"),
    ],
)
def test_chaos_checker_fails_a_planted_bug(
    tmp_path: Path, bug: str, scenario: str, anomaly: str
) -> None:
    code, result, output = _chaos(
        tmp_path / bug,
        "--scenario",
        scenario,
        "--planted",
        bug,
        "--seed",
        str(PLANTED_SEED),
        timeout_s=180,
    )
    check = result["check"]
    assert not check["valid"], output[-4000:]
    assert code == 1, output[-4000:]
    assert check["violations"].get(anomaly, 0) >= 1, check["violations"]
    assert check["examples"][anomaly], check["examples"]
    for role in ("a", "recv-"):  # adapters and receivers alike run under the bug
        logs = "".join(p.read_text() for p in (tmp_path / bug / "logs").glob(f"{role}*.log"))
        assert f"planted: {bug} active" in logs, role


@pytest.mark.timeout(200)
@pytest.mark.parametrize("scenario", ["ingest-crash", "zombie", "forged-reply"])
def test_chaos_planted_scenario_passes_without_the_bug(tmp_path: Path, scenario: str) -> None:
    code, result, output = _chaos(
        tmp_path / scenario, "--scenario", scenario, "--seed", str(PLANTED_SEED), timeout_s=180
    )
    assert result["check"]["valid"], output[-4000:]
    assert code == 0, output[-4000:]
    assert sum(result["check"]["info"]["faults_by_kind"].values()) >= 1
