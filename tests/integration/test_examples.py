"""Every Python snippet of the README is a file under ``examples/`` (checked verbatim), and
every example runs, as a subprocess against a real redis-server: publish a request, run
the adapter from Python (``run_forever``, SIGTERM to stop), ask and await with the quick
start's ``Client``, receive the replies, the side-effect snippets, the Router's schema
(``broker-adapter schema``) and the testing snippet (pytest with the plugin's fixtures)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import cli_env, count_rows, wait_for
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
README_URL = "redis://localhost:6390/0"


def test_every_readme_python_snippet_is_an_example_file() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    snippets = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert len(snippets) >= 8
    texts = {p.name: p.read_text(encoding="utf-8") for p in EXAMPLES.glob("*.py")}
    for snippet in snippets:
        assert any(snippet in text for text in texts.values()), snippet


def _copy_examples(tmp: Path, redis_url: str) -> None:
    for path in EXAMPLES.glob("*.py"):
        (tmp / path.name).write_text(
            path.read_text(encoding="utf-8").replace(README_URL, redis_url)
        )
    keyring = tmp / "keyring.json"
    keyring.write_text(json.dumps({"planner": {"p1": "the planner's secret, 32 bytes or more"}}))
    keyring.chmod(0o600)


def _run(tmp: Path, name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, name], cwd=tmp, capture_output=True, text=True, timeout=120, env=cli_env()
    )


def _start(tmp: Path, name: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, name],
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(),
    )


def test_every_example_runs(redis_server: RedisServer, tmp_path: Path) -> None:
    _copy_examples(tmp_path, redis_server.url)
    published = _run(tmp_path, "publish.py")
    assert published.returncode == 0, published.stderr
    adapter = _start(tmp_path, "run_adapter.py")
    receiver = None
    try:
        db = tmp_path / "adapter.db"
        wait_for(
            lambda: count_rows(db, "SELECT count(*) FROM tasks WHERE state = 'done'"),
            "the published request done",
            timeout_s=120,
        )
        asked = _run(tmp_path, "quickstart.py")
        assert asked.returncode == 0, asked.stderr
        assert asked.stdout.strip() == "{'restarted': 'web'}"
        receiver = _start(tmp_path, "receive.py")
        wait_for(
            lambda: count_rows(tmp_path / "planner.db", "SELECT count(*) FROM done") == 2,
            "both replies received",
            timeout_s=120,
        )
        adapter.send_signal(signal.SIGTERM)  # run_forever drains and returns 0
        assert adapter.wait(timeout=120) == 0
    finally:
        for proc in (adapter, receiver):
            if proc is not None:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                assert proc.stdout is not None
                proc.stdout.close()
    effects = _run(tmp_path, "effects.py")
    assert effects.returncode == 0, effects.stderr
    assert effects.stdout.startswith("effects ok")
    schema = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "schema",
            "--app",
            "router:router",
            "--app-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
    )
    assert schema.returncode == 0, schema.stderr
    names = [task["name"] for task in json.loads(schema.stdout)["tasks"]]
    assert sorted(names) == ["restart", "summarise"]
    tested = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "router_test.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=cli_env(),
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "2 passed" in tested.stdout
