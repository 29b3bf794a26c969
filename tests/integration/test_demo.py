"""`make demo`'s command runs the story end to end and every check in its report holds."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support.cli import cli_env, wait_for
from tests.support.redis_server import RedisServer, free_port, require_binary

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _demo(env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "broker_adapter", "demo", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_demo_on_a_throwaway_redis_server_passes_every_check() -> None:
    require_binary()
    res = _demo(dict(os.environ))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "redis-server (throwaway" in res.stdout
    assert res.stdout.count("[ok]") == 5
    assert "FAILED" not in res.stdout
    assert "refused (fence)" in res.stdout
    assert "`broker-adapter demo --keep DIR` keeps its" in res.stdout


def test_demo_falls_back_to_the_embedded_fake_server_without_a_binary() -> None:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no redis-server on it
    res = _demo(env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "fakeredis TCP server" in res.stdout
    assert res.stdout.count("[ok]") == 5


def test_demo_keep_prints_a_console_command_that_opens_the_demos_data(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    pytest.importorskip("starlette")
    require_binary()
    keep = tmp_path / "kept"
    res = _demo(dict(os.environ), "--keep", str(keep))
    assert res.returncode == 0, res.stdout + res.stderr
    (command,) = [
        line.strip()
        for line in res.stdout.splitlines()
        if line.strip().startswith("broker-adapter console ")
    ]
    token = res.stdout.rsplit("sign in with the token ", 1)[1].split()[0]
    for name in ("adapter.db", "charges.db", "tokens.json"):
        assert stat.S_IMODE((keep / name).stat().st_mode) == 0o600
    again = _demo(dict(os.environ), "--keep", str(keep))
    assert again.returncode == 2
    assert "exists already" in again.stderr
    args = shlex.split(command)[1:]
    args[args.index("--redis") + 1] = redis_server.url  # the demo's own Redis is gone
    port = free_port()
    console = subprocess.Popen(
        [sys.executable, "-m", "broker_adapter", *args, "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=cli_env(),
    )
    try:
        url = f"http://127.0.0.1:{port}/?db=0"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})

        def page() -> str:
            try:
                with urllib.request.urlopen(request, timeout=5) as answer:
                    return str(answer.read().decode("utf-8"))
            except OSError:
                return ""

        wait_for(lambda: "planner" in page(), "the console to show the demo's tasks")
    finally:
        console.terminate()
        console.wait(timeout=30)
