"""The wheel as people install it: into a fresh virtual environment with no extras, then
``broker-adapter --version`` and ``broker-adapter demo``, with and without a redis-server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from broker_adapter import __version__
from tests.support.redis_server import require_binary

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)  # type: ignore[call-overload,no-any-return]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the built wheel installed (no extras); yields its bin directory."""
    work = tmp_path_factory.mktemp("install")
    build = [sys.executable, "-m", "build", "--no-isolation", "--wheel"]
    built = _run([*build, "--outdir", str(work / "dist"), str(ROOT)])
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = (work / "dist").glob("broker_adapter-*.whl")
    made = _run([sys.executable, "-m", "venv", str(work / "venv")])
    assert made.returncode == 0, made.stderr
    bin_dir = work / "venv" / "bin"
    pip = _run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", str(wheel)])
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    return bin_dir


def test_the_installed_command_says_its_version(installed: Path) -> None:
    res = _run([str(installed / "broker-adapter"), "--version"])
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"broker-adapter {__version__}"


def test_the_installed_demo_runs_on_a_redis_server_without_any_extra(installed: Path) -> None:
    require_binary()
    fakeredis = _run([str(installed / "python"), "-c", "import fakeredis"])
    assert fakeredis.returncode != 0, "the fresh venv must not have fakeredis (no extras)"
    res = _run([str(installed / "broker-adapter"), "demo"], cwd=installed.parent)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("[ok]") == 5
    assert "PASS" in res.stdout


def test_the_installed_demo_without_redis_says_what_to_install(installed: Path) -> None:
    env = {**os.environ, "PATH": str(installed)}  # no redis-server on it, no fakeredis
    res = _run([str(installed / "broker-adapter"), "demo"], cwd=installed.parent, env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "apt-get install redis-server" in res.stderr
    assert "broker_adapter[demo]" in res.stderr
    assert "Traceback" not in res.stderr
