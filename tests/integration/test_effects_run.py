"""``broker-adapter run`` with a handler whose effect requires approval: the task waits
(``waiting_approval``, in ``status``), a forged approval in its payload counts for nothing,
``broker-adapter approve`` lets the adapter's reconcile thread release it, and the effect
reaches the fake target (its own process) once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import cli_env, count_rows, publish, wait_for
from tests.support.cli import run_cli as _cli
from tests.support.fake_target import FakeTarget
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_run_holds_an_unapproved_effect_until_an_operator_approves_it(
    redis_server: RedisServer, tmp_path: Path, prefix: str
) -> None:
    keyring = tmp_path / "keyring.json"
    keyring.write_text(json.dumps({"alice": {"k1": "alice-secret: a test key of 32 bytes+"}}))
    keyring.chmod(0o600)
    db = tmp_path / "adapter.db"
    with FakeTarget(tmp_path / "target", idempotent=False) as target:
        payload = {"target": target.url, "server": "web1", "human_approved": True}
        publish(redis_server.url, keyring, prefix, "restart-1", payload)
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
                "--handler",
                "tests.support.effect_handlers:approved",
                "--workers",
                "1",
                "--keyring",
                str(keyring),
                "--prefix",
                prefix,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=cli_env(),
        )
        try:
            waiting = "SELECT count(*) FROM tasks WHERE state = 'waiting_approval'"
            wait_for(lambda: db.exists() and count_rows(db, waiting) == 1, "the task to wait")
            status = _cli("status", "--db", str(db), "--json")
            assert status.returncode == 0, status.stderr
            report = json.loads(status.stdout)
            assert report["processing"]["waiting_approval"] == 1
            assert report["effects"]["waiting_approval"] == 1
            assert target.effects() == []  # the payload's "human_approved" means nothing
            # the approver sees what the task asks (principal, arguments and their digest)
            # and approves exactly that
            listed = _cli("approvals", "--db", str(db))
            assert listed.returncode == 0, listed.stderr
            (asked,) = [json.loads(line) for line in listed.stdout.splitlines()]
            assert (asked["action"], asked["target"], asked["scope"], asked["principal"]) == (
                "apply",
                "web1",
                "restart",
                "alice",
            )
            assert asked["arguments"] == payload
            granted = _cli(
                "approve",
                "--db",
                str(db),
                "--task",
                asked["task_id"],
                "--expires-in",
                "600",
                "--by",
                "carol",
            )
            assert granted.returncode == 0, granted.stderr
            shown = json.loads(granted.stdout)
            assert shown["arguments_digest"] == asked["arguments_digest"]
            assert (shown["principal"], shown["uses"]) == ("alice", 1)
            done = "SELECT count(*) FROM tasks WHERE state = 'done'"
            wait_for(lambda: count_rows(db, done) == 1, "the approved task to run")
        finally:
            run.send_signal(signal.SIGTERM)
            code = run.wait(timeout=60)
            output = run.stdout.read() if run.stdout else ""
            if run.stdout:
                run.stdout.close()
        assert code == 0, output
        assert len(target.effects()) == 1
