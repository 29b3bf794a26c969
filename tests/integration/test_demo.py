"""`make demo`'s command runs the story end to end and every check in its report holds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.redis_server import require_binary

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _demo(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "broker_adapter", "demo"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def test_demo_on_a_throwaway_redis_server_passes_every_check() -> None:
    require_binary()
    res = _demo(dict(os.environ))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "redis-server (throwaway" in res.stdout
    assert res.stdout.count("[ok]") == 5
    assert "FAILED" not in res.stdout
    assert "refused (fence)" in res.stdout


def test_demo_falls_back_to_the_embedded_fake_server_without_a_binary() -> None:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no redis-server on it
    res = _demo(env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "fakeredis TCP server" in res.stdout
    assert res.stdout.count("[ok]") == 5
