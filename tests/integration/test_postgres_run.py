"""``broker-adapter run --db postgresql://...``: two adapter processes (standing in for two
hosts) share one PostgreSQL database and one Redis, end to end with real subprocesses."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from broker_adapter.client.publisher import Publisher
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect
from tests.support.cli import cli_env, publish, publish_range, wait_for
from tests.support.cli import run_cli as _cli
from tests.support.fake_target import FakeTarget
from tests.support.ingest_script import envelope, real_deadline
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _start_run(
    redis_url: str, db: str, keyring: Path, prefix: str, name: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "run",
            "--redis",
            redis_url,
            "--db",
            db,
            "--handler",
            "broker_adapter.examples:echo",
            "--workers",
            "2",
            "--keyring",
            str(keyring),
            "--prefix",
            prefix,
            "--name",
            name,
            "--lease",
            "2",
            "--claim-min-idle-ms",
            "1000",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        env=cli_env(),
    )


def _count(url: str, sql: str) -> int:
    """One count, 0 while the adapters have not made the tables yet."""
    try:
        with psycopg.connect(url) as conn:
            row = conn.execute(sql).fetchone()
    except psycopg.errors.UndefinedTable:
        return 0
    return int(row[0]) if row and row[0] is not None else 0


@pytest.fixture
def keyring(tmp_path: Path) -> Path:
    path = tmp_path / "keyring.json"
    path.write_text(json.dumps({"alice": {"k1": "alice-secret: a test key of 32 bytes or more"}}))
    path.chmod(0o600)
    return path


#: The deadline of every request ``publish_range`` sends here: a resend is the same request.
DEADLINE = time.time() + 3600


def _stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> int:
    proc.send_signal(sig)
    return proc.wait(timeout=60)


def test_two_adapters_on_one_postgres_database_answer_each_request_once(
    redis_server: RedisServer, keyring: Path, prefix: str, pg_url: str
) -> None:
    """Two adapters share the inbound group and the database; one is SIGKILLed mid-run and
    the other takes its pending entries over: every request answered once, resends and
    takeovers deduplicated by the one inbox."""
    n = 30
    publish_range(redis_server.url, keyring, prefix, range(n), deadline=DEADLINE)
    publish_range(
        redis_server.url, keyring, prefix, range(5), deadline=DEADLINE
    )  # resends: duplicates
    a = _start_run(redis_server.url, pg_url, keyring, prefix, "host-a")
    b = _start_run(redis_server.url, pg_url, keyring, prefix, "host-b")
    try:
        wait_for(lambda: _count(pg_url, "SELECT count(*) FROM tasks") > 0, "first tasks")
        a.kill()  # a dead host: its claimed tasks and pending entries are B's after the lease
        a.wait(timeout=30)
        publish_range(redis_server.url, keyring, prefix, range(n, n + 10), deadline=DEADLINE)
        wait_for(
            lambda: _count(pg_url, "SELECT count(*) FROM outbox WHERE state = 'sent'") == n + 10,
            "every reply sent",
            timeout_s=120,
        )
    finally:
        if a.poll() is None:
            a.kill()
        assert _stop(b) == 0
    assert _count(pg_url, "SELECT count(*) FROM tasks") == n + 10
    assert _count(pg_url, "SELECT count(*) FROM inbox") == n + 10
    assert _count(pg_url, "SELECT sum(duplicates) FROM inbox") >= 5
    assert _count(pg_url, "SELECT count(*) FROM tasks WHERE state <> 'done'") == 0
    status = _cli(
        "status", "--db", pg_url, "--redis", redis_server.url, "--prefix", prefix, "--json"
    )
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["received"]["inbox"] == n + 10
    assert report["terminal"]["done"] == report["delivery"]["sent"] == n + 10
    assert report["processing"]["running"] == 0
    # The receiver keeps its receipts in PostgreSQL too (its own schema here).
    res = _cli(
        "receive",
        "--redis",
        redis_server.url,
        "--db",
        pg_url,
        "--principal",
        "alice",
        "--prefix",
        prefix,
        "--until-idle",
        "1.5",
        "--keyring",
        str(keyring),
    )
    assert res.returncode == 0, res.stderr
    assert _count(pg_url, "SELECT count(*) FROM receipts") == n + 10
    assert _count(pg_url, "SELECT count(DISTINCT reply_id) FROM receipts") == n + 10


def test_the_operator_commands_work_on_a_postgres_database(pg_url: str) -> None:
    """cancel, receipts, dead-letters and status on a PostgreSQL database; backup, which
    copies a SQLite file, refuses it with one clear line."""
    from broker_adapter.clock import FakeClock
    from tests.support.store_script import item, open_any, stores

    with open_any(pg_url) as db:
        (res,) = stores(db, FakeClock()).tasks.accept([item("m1")])
    assert res.task_id is not None
    cancelled = _cli("cancel", "--db", pg_url, res.task_id)
    assert cancelled.returncode == 0, cancelled.stderr
    out = json.loads(cancelled.stdout)
    assert out.pop("by").endswith(")")  # "NAME (os user U)": who cancelled is recorded
    assert out == {"task_id": res.task_id, "state": "cancelled"}
    listed = _cli("dead-letters", "list", "--db", pg_url)
    assert listed.returncode == 0, listed.stderr
    receipts = _cli("receipts", "--db", pg_url, "--json")
    assert (receipts.returncode, receipts.stdout) == (0, "")
    status = _cli("status", "--db", pg_url, "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert (report["terminal"]["cancelled"], report["delivery"]["pending"]) == (1, 1)
    backup = _cli("backup", "--db", pg_url, "--out", "/nonexistent/x.db")
    assert backup.returncode != 0
    assert "needs a SQLite file" in backup.stderr


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_run_on_postgres_answers_a_request_in_the_trace_it_was_sent_in(
    redis_server: RedisServer, keyring: Path, prefix: str, pg_url: str
) -> None:
    """A request sent in a trace is answered in it (the task keeps its ``traceparent``,
    migration 2, and the reply body carries it), with the hand-off on as on SQLite."""
    publisher = Publisher(connect(redis_server.url), Keys(prefix), "alice", Keyring.load(keyring))
    publisher.publish(envelope("traced", deadline=real_deadline()), traceparent=TRACEPARENT)
    publisher.publish(envelope("plain", deadline=real_deadline()))
    run = _start_run(redis_server.url, pg_url, keyring, prefix, "host-a")
    try:
        wait_for(
            lambda: _count(pg_url, "SELECT count(*) FROM outbox WHERE state = 'sent'") == 2,
            "both replies sent",
            timeout_s=60,
        )
    finally:
        assert _stop(run) == 0
    with psycopg.connect(pg_url) as conn:
        kept: dict[str, str | None] = dict(
            conn.execute("SELECT message_id, traceparent FROM tasks").fetchall()
        )
        bodies = {
            mid: json.loads(bytes(body))
            for mid, body in conn.execute("SELECT message_id, body FROM outbox").fetchall()
        }
    assert kept == {"traced": TRACEPARENT, "plain": None}
    assert bodies["traced"]["status"] == bodies["plain"]["status"] == "done"
    assert bodies["traced"]["traceparent"] == TRACEPARENT
    assert "traceparent" not in bodies["plain"]


def _start_effects_run(
    redis_url: str, db: str, keyring: Path, prefix: str, name: str, handler: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "run",
            "--redis",
            redis_url,
            "--db",
            db,
            "--handler",
            f"tests.support.effect_handlers:{handler}",
            "--workers",
            "1",
            "--keyring",
            str(keyring),
            "--prefix",
            prefix,
            "--name",
            name,
            "--lease",
            "2",
            "--claim-min-idle-ms",
            "1000",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        env=cli_env(),
    )


def _reply_of(url: str, message_id: str) -> dict[str, Any]:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT body FROM outbox WHERE message_id = %s AND state = 'sent'", (message_id,)
        ).fetchone()
    assert row is not None
    body: dict[str, Any] = json.loads(bytes(row[0]))
    return body


def test_run_on_postgres_reconciles_an_effect_whose_answer_was_lost_once(
    redis_server: RedisServer, keyring: Path, prefix: str, pg_url: str, tmp_path: Path
) -> None:
    """A host dies after its handler's effect reached the target, before the answer: the
    other host takes the lapsed lease back to ``unknown`` (not ``pending``: a retry could
    repeat the effect), its reconcile thread asks the target, finds the effect and ends the
    task ``done`` with what it found. The effect happened once; the reply says how."""
    with FakeTarget(tmp_path / "target", idempotent=False) as target:
        payload = {"target": target.url, "value": 1, "hang_after": True}
        publish(redis_server.url, keyring, prefix, "apply-1", payload)
        a = _start_effects_run(redis_server.url, pg_url, keyring, prefix, "host-a", "irreversible")
        try:
            wait_for(lambda: len(target.effects()) == 1, "the effect to reach the target")
            started = "SELECT count(*) FROM tasks WHERE effect_fence = fence AND state = 'running'"
            assert _count(pg_url, started) == 1
        finally:
            a.kill()  # host A dies with the effect's answer
            a.wait(timeout=30)
        b = _start_effects_run(redis_server.url, pg_url, keyring, prefix, "host-b", "irreversible")
        try:
            wait_for(
                lambda: _count(pg_url, "SELECT count(*) FROM outbox WHERE state = 'sent'") == 1,
                "the reconciled task's reply sent",
                timeout_s=60,
            )
        finally:
            assert _stop(b) == 0
        effects = target.effects()
    assert len(effects) == 1  # reconciled, never run again
    assert _count(pg_url, "SELECT count(*) FROM tasks WHERE state = 'done'") == 1
    assert _count(pg_url, "SELECT count(*) FROM reconcile_log WHERE outcome = 'done'") == 1
    assert _count(pg_url, "SELECT count(*) FROM reconcile_log") == 1
    body = _reply_of(pg_url, "apply-1")
    assert body["status"] == "done"
    assert body["result"] == {"effect_ids": [effects[0]["effect_id"]]}
    assert body["effects"]["reconciled"]["outcome"] == "done"
    status = _cli("status", "--db", pg_url, "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["effects"]["reconciled_done"] == 1


def test_a_cancel_of_a_running_task_on_postgres_is_a_request_its_handler_sees(
    redis_server: RedisServer, keyring: Path, prefix: str, pg_url: str
) -> None:
    """``broker-adapter cancel`` of a running task on PostgreSQL records a request: the
    handler sees it at its next check and stops, and the task ends ``cancelled`` with a
    reply saying what was done."""
    publish(redis_server.url, keyring, prefix, "long-1", {})
    run = _start_effects_run(redis_server.url, pg_url, keyring, prefix, "host-a", "cancellable")
    try:
        running = "SELECT count(*) FROM tasks WHERE state = 'running'"
        wait_for(lambda: _count(pg_url, running) == 1, "the handler to run")
        with psycopg.connect(pg_url) as conn:
            row = conn.execute("SELECT task_id FROM tasks").fetchone()
        assert row is not None
        cancelled = _cli("cancel", "--db", pg_url, row[0], "--reason", "operator")
        assert cancelled.returncode == 0, cancelled.stderr
        out = json.loads(cancelled.stdout)
        assert out.pop("by").endswith(")")  # "NAME (os user U)"
        assert out == {"task_id": row[0], "state": "running", "cancel_requested": True}
        wait_for(
            lambda: _count(pg_url, "SELECT count(*) FROM outbox WHERE state = 'sent'") == 1,
            "the cancelled task's reply sent",
            timeout_s=60,
        )
    finally:
        assert _stop(run) == 0
    body = _reply_of(pg_url, "long-1")
    assert body["status"] == "cancelled"
    assert body["error"].startswith("cancel requested ")
    assert "RuntimeError: stopped on its cancel" in body["error"]
    assert _count(pg_url, "SELECT count(*) FROM tasks WHERE state = 'cancelled'") == 1


def test_the_effect_commands_work_on_a_postgres_database(pg_url: str) -> None:
    """``approve``, ``revoke`` and ``reconcile`` keep their records in the PostgreSQL
    database a URL names, never in a file of that name."""
    from broker_adapter.clock import FakeClock
    from broker_adapter.store.effects import EffectsStore
    from tests.support.store_script import item, open_any, stores

    granted = _cli(
        "approve",
        "restart",
        "--target",
        "web1",
        "--scope",
        "prod",
        "--principal",
        "agent-a",
        "--arguments",
        '{"server": "web1"}',
        "--uses",
        "2",
        "--expires-in",
        "60",
        "--db",
        pg_url,
        "--by",
        "alice",
    )
    assert granted.returncode == 0, granted.stderr
    approval_id = json.loads(granted.stdout)["approval_id"]
    revoked = _cli("revoke", approval_id, "--db", pg_url, "--by", "alice")
    assert (revoked.returncode, json.loads(revoked.stdout)["revoked"]) == (0, True)
    with open_any(pg_url) as db:
        s = stores(db, FakeClock())
        s.tasks.accept([item("m1")])
        (task,) = s.tasks.claim("w1")
        fx = EffectsStore(s.tasks.tx)
        fx.mark_effect_started(task.task_id, "w1", task.fence)
        fx.to_unknown(task.task_id, "w1", task.fence, "timed out")
    answered = _cli(
        "reconcile",
        task.task_id,
        "--outcome",
        "done",
        "--result",
        '{"ok": 1}',
        "--db",
        pg_url,
        "--by",
        "alice",
    )
    assert answered.returncode == 0, answered.stderr
    assert json.loads(answered.stdout) == {"task_id": task.task_id, "state": "done"}
    with psycopg.connect(pg_url) as conn:
        rows = conn.execute(
            "SELECT approver, revoked_by, principal, uses FROM approvals"
        ).fetchall()
        logged = conn.execute("SELECT outcome, by_whom FROM reconcile_log").fetchall()
    ((by, revoked_by, principal, uses),), ((outcome, who),) = rows, logged
    assert (principal, uses) == ("agent-a", 2)
    assert by.startswith("alice (os user ")
    assert revoked_by.startswith("alice (os user ")
    assert (outcome, who.split(" ")[0]) == ("done", "alice")
    assert not any(ROOT.glob("postgresql:*"))
