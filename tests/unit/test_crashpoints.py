"""Crash points: the spec parser, the catalogue, and @n counting in a real child process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from broker_adapter import crashpoints
from broker_adapter.clock import FakeClock
from broker_adapter.errors import ConfigError
from broker_adapter.store import open_database
from broker_adapter.store.settle import SETTLE_OPS
from tests.support.store_script import T0, dump, item, stores

ROOT = Path(__file__).resolve().parents[2]
STORE_DIR = ROOT / "broker_adapter" / "store"
POINT = "store.claim.after_commit"


def test_crashpoints_catalogue_covers_every_store_write() -> None:
    ops = set()
    for source in STORE_DIR.glob("*.py"):
        ops |= set(re.findall(r"\.write\(\"([a-z_]+)\"\)", source.read_text()))
    ops |= set(SETTLE_OPS)  # settle.settle's transaction is named by its caller
    assert ops >= {
        "accept",
        "claim",
        "finish",
        "fail",
        "cancel",
        "renew",
        "outbox_claim",
        "mark_sent",
        "reply_retry",
        "reply_dead",
        "reply_replay",
        "receipt",
    }
    for op in ops:
        for window in ("before_commit", "after_commit"):
            assert f"store.{op}.{window}" in crashpoints.POINTS
    assert all(description for description in crashpoints.POINTS.values())


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (POINT, (POINT, 1)),
        (f"{POINT}@1", (POINT, 1)),
        (f"{POINT}@3", (POINT, 3)),
        (f"  {POINT}@12\n", (POINT, 12)),
        ("worker.after_effect", ("worker.after_effect", 1)),
    ],
)
def test_crashpoints_parse_spec_accepts_name_and_count(
    spec: str, expected: tuple[str, int]
) -> None:
    assert crashpoints.parse_spec(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("store.claim.during_commit", "unknown crash point"),
        ("", "unknown crash point"),
        ("@2", "unknown crash point"),
        ("STORE.CLAIM.AFTER_COMMIT", "unknown crash point"),
        (f"{POINT}@0", ">= 1"),
        (f"{POINT}@-1", "whole number"),
        (f"{POINT}@x", "whole number"),
        (f"{POINT}@1.5", "whole number"),
        (f"{POINT}@", "whole number"),
        (f"{POINT}@ 2", "whole number"),
        (f"{POINT}@+2", "whole number"),
        (f"{POINT}@3_0", "whole number"),
        (f"{POINT}@٣", "whole number"),
        (f"{POINT}@2@3", "whole number"),
    ],
)
def test_crashpoints_parse_spec_raises_config_error_when_malformed(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        crashpoints.parse_spec(spec)


def test_crashpoints_hit_is_noop_when_unarmed() -> None:
    for name in crashpoints.POINTS:
        crashpoints.hit(name)


def test_crashpoints_hit_ignores_other_points_when_armed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(crashpoints.ENV_CRASH, "receiver.after_xack")
    crashpoints.reset()
    for _ in range(3):
        crashpoints.hit(POINT)  # still alive


def test_crashpoints_hit_raises_config_error_when_env_names_unknown_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(crashpoints.ENV_CRASH, "store.claim.typo")
    crashpoints.reset()
    with pytest.raises(ConfigError, match="unknown crash point"):
        crashpoints.hit(POINT)


def prepare(tmp_path: Path, tasks: int) -> Path:
    path = tmp_path / "cp.db"
    with open_database(path) as db:
        s = stores(db, FakeClock(T0))
        s.tasks.accept([item(f"m{n}") for n in range(tasks)])
    return path


def child_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (crashpoints.ENV_CRASH, crashpoints.ENV_PAUSE)
    }
    env.update(extra)
    return env


def claim_each(path: Path, times: int) -> list[str]:
    args = json.dumps({"owner": "w1", "times": times})
    return [
        sys.executable,
        "-m",
        "tests.support.store_script",
        "op",
        str(path),
        repr(T0 + 1),
        "claim_each",
        args,
    ]


def running(path: Path) -> int:
    with open_database(path) as db:
        return sum(1 for t in dump(db)["tasks"] if t["state"] == "running")


@pytest.mark.crash
@pytest.mark.parametrize(("window", "committed"), [("after_commit", 3), ("before_commit", 2)])
def test_crashpoints_fire_on_nth_hit_when_count_given(
    tmp_path: Path, window: str, committed: int
) -> None:
    path = prepare(tmp_path, 5)
    env = child_env(**{crashpoints.ENV_CRASH: f"store.claim.{window}@3"})
    proc = subprocess.run(
        claim_each(path, 5),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # Two claims reported back; the third died inside (before or after its COMMIT).
    assert len(proc.stdout.splitlines()) == 2
    assert running(path) == committed


@pytest.mark.crash
def test_crashpoints_pause_stops_process_until_continued(tmp_path: Path) -> None:
    path = prepare(tmp_path, 2)
    env = child_env(**{crashpoints.ENV_PAUSE: f"{POINT}@2"})
    proc = subprocess.Popen(
        claim_each(path, 2),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)  # returns once the child is stopped
        assert os.WIFSTOPPED(status)
        assert os.WSTOPSIG(status) == signal.SIGSTOP
        assert running(path) == 2  # the second claim is durable while the process is frozen
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert len(out.splitlines()) == 3  # two progress lines and the final result
