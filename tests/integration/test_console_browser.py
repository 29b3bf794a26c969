"""The web console in a real headless browser (Playwright driving Debian's Chromium), against
real processes: a redis-server, two ``broker-adapter run`` adapters (A: an ordinary handler
with a quota of one open task per principal; B: an effect that ``requires_approval``) and
``broker-adapter console --db A --db B``.

Chromium comes from Debian's ``chromium`` package (``.ci/run`` installs it); Playwright
cannot download its own browsers here. Where it is missing the tests skip, saying so,
except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.app.ops import dead_letter_entries
from broker_adapter.client.publisher import Publisher
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect
from tests.support.cli import cli_env, count_rows, wait_for
from tests.support.fake_target import FakeTarget, FakeTargetClient
from tests.support.handlers import init_effects_db
from tests.support.redis_server import RedisServer, free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
PRINCIPALS = ("alice", "carol", "dave", "erin", "frank", "mallory")
ALICE_TOKEN = "alice-console-token-0123456789"
PAGES = ("/", "/tasks", "/decisions", "/dead-letters")
ACTIONS = (
    "/actions/approve",
    "/actions/deny",
    "/actions/reconcile",
    "/actions/cancel",
    "/actions/replay",
)


def _require_browser() -> Any:
    """Playwright's sync API, or a skip (a failure under CI=true) saying what is missing."""
    missing = None
    try:
        from playwright import sync_api
    except ImportError:
        missing = "the playwright package is not installed (the dev extra has it)"
    if missing is None and not os.access(CHROMIUM, os.X_OK):
        missing = f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run does)"
    if missing is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the console's browser tests cannot run under CI: {missing}")
        pytest.skip(missing)
    return sync_api


@dataclass
class Rig:
    console: str
    db_a: Path
    db_b: Path
    prefix_a: str
    prefix_b: str
    redis_url: str
    keyring: Keyring
    target: FakeTargetClient
    effects_db: Path
    shots: Path

    def publish(self, prefix: str, principal: str, mid: str, payload: dict[str, Any]) -> None:
        publisher = Publisher(connect(self.redis_url), Keys(prefix), principal, self.keyring)
        publisher.publish(
            Envelope.build(
                message_id=mid, sender=principal, payload=payload, deadline=time.time() + 600
            )
        )

    def task_id(self, db: Path, principal: str, mid: str) -> str:
        import sqlite3

        conn = sqlite3.connect(db, timeout=10)
        try:
            row = conn.execute(
                "SELECT task_id FROM tasks WHERE principal = ? AND message_id = ?",
                (principal, mid),
            ).fetchone()
        finally:
            conn.close()
        assert row is not None, (principal, mid)
        return str(row[0])


def _state_is(db: Path, mid: str, state: str) -> bool:
    return (
        count_rows(
            db, f"SELECT count(*) FROM tasks WHERE message_id = '{mid}' AND state = '{state}'"
        )
        == 1
    )


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "broker_adapter", *args],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=cli_env(),
        )


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as res:
            return bool(res.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def rig(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    _require_browser()
    work = tmp_path_factory.mktemp("console")
    keyring_path = work / "keyring.json"
    keyring_path.write_text(
        json.dumps({p: {"k1": f"{p}-secret: a test key of 32 bytes or more"} for p in PRINCIPALS})
    )
    keyring_path.chmod(0o600)
    tokens = work / "tokens.json"
    tokens.write_text(
        json.dumps(
            {
                "alice": ALICE_TOKEN,
                "grafana": {"token": "grafana-token-0123456789", "read_only": True},
            }
        )
    )
    tokens.chmod(0o600)
    effects_db = work / "effects.db"
    init_effects_db(effects_db)
    run_id = uuid.uuid4().hex[:8]
    prefix_a, prefix_b = f"ca{run_id}", f"cb{run_id}"
    db_a, db_b = work / "adapter-a.db", work / "adapter-b.db"
    port = free_port()
    common = ["--redis", redis_server.url, "--workers", "1", "--keyring", str(keyring_path)]
    procs: list[subprocess.Popen[bytes]] = []
    with FakeTarget(work / "target", idempotent=False) as target:
        try:
            procs.append(
                _spawn(
                    [
                        "run",
                        *common,
                        "--db",
                        str(db_a),
                        "--prefix",
                        prefix_a,
                        "--handler",
                        "tests.support.console_handlers:handler",
                        "--max-open-tasks",
                        "1",
                    ],
                    work / "adapter-a.log",
                )
            )
            procs.append(
                _spawn(
                    [
                        "run",
                        *common,
                        "--db",
                        str(db_b),
                        "--prefix",
                        prefix_b,
                        "--handler",
                        "tests.support.effect_handlers:approved",
                    ],
                    work / "adapter-b.log",
                )
            )
            # The console opens the stores it lists: wait for the adapters to make them.
            wait_for(lambda: db_a.exists() and db_b.exists(), "the adapters' databases")
            wait_for(
                lambda: (
                    count_rows(db_a, "SELECT count(*) FROM meta") > 0
                    and count_rows(db_b, "SELECT count(*) FROM meta") > 0
                ),
                "the adapters' schemas",
            )
            procs.append(
                _spawn(
                    [
                        "console",
                        "--db",
                        str(db_a),
                        "--db",
                        str(db_b),
                        "--redis",
                        redis_server.url,
                        "--prefix",
                        prefix_a,
                        "--port",
                        str(port),
                        "--tokens",
                        str(tokens),
                    ],
                    work / "console.log",
                )
            )
            console = f"http://127.0.0.1:{port}"
            wait_for(lambda: _answers(f"{console}/login"), "the console to answer")
            yield Rig(
                console,
                db_a,
                db_b,
                prefix_a,
                prefix_b,
                redis_server.url,
                Keyring.load(keyring_path),
                target,
                effects_db,
                work / "screenshots",
            )
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture(scope="module")
def browser(rig: Rig) -> Iterator[Any]:
    sync_api = _require_browser()
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh browser context (no cookie) and its page."""
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    context.on("dialog", lambda d: pytest.fail(f"a page opened a dialog: {d.message}"))
    tab = context.new_page()
    yield tab
    context.close()


def _login(page: Any, rig: Rig) -> None:
    page.goto(f"{rig.console}/login")
    page.fill("input[name=token]", ALICE_TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(f"{rig.console}/")
    assert "alice" in page.inner_text("header")


def test_login_and_a_published_task_appears_in_the_pipeline(page: Any, rig: Rig) -> None:
    rig.publish(
        rig.prefix_a, "alice", "hello-1", {"effects_db": str(rig.effects_db), "value": "hello"}
    )
    wait_for(lambda: _state_is(rig.db_a, "hello-1", "done"), "the task to be done")
    wait_for(
        lambda: count_rows(rig.db_a, "SELECT count(*) FROM outbox WHERE state = 'sent'") >= 1,
        "its reply to be sent",
    )
    _login(page, rig)
    page.goto(f"{rig.console}/?db=0")
    groups = page.inner_text("#groups")
    assert "alice" in groups
    assert "done 1" in groups
    assert "1. Received" in page.inner_text("#stage-received")
    assert page.locator('meta[http-equiv="refresh"]').count() == 1
    page.click("#groups a:text('alice')")
    assert "hello-1" in page.inner_text("#task-list")


def test_an_approval_from_the_page_runs_the_handler_once_and_shows_who_approved(
    page: Any, rig: Rig
) -> None:
    rig.publish(rig.prefix_b, "dave", "restart-1", {"target": rig.target.url, "server": "web1"})
    wait_for(lambda: _state_is(rig.db_b, "restart-1", "waiting_approval"), "the task to wait")
    assert rig.target.effects() == []
    _login(page, rig)
    page.goto(f"{rig.console}/decisions?db=1")
    task_id = rig.task_id(rig.db_b, "dave", "restart-1")
    row = page.locator("#waiting-approval tr", has_text=task_id)
    assert "web1" in row.inner_text()
    assert "restart" in row.inner_text()
    row.locator("input[name=expires_in]").fill("600")
    row.locator("button.approve-button").click()
    page.wait_for_url(f"**/tasks/{task_id}?*")
    assert "approved by alice" in page.inner_text(".note")
    wait_for(lambda: _state_is(rig.db_b, "restart-1", "done"), "the approved task to run")
    page.reload()
    assert page.inner_text("#task-state") == "done"
    assert "alice (console)" in page.inner_text("#approvals")
    assert "released by an approval" in page.inner_text("#events")
    assert len(rig.target.effects()) == 1  # the handler ran exactly once


def test_an_unknown_outcome_answered_from_the_form_ends_done_with_its_reply(
    page: Any, rig: Rig
) -> None:
    rig.publish(rig.prefix_a, "erin", "lost-1", {"lose_answer": True})
    waiting = (
        "SELECT count(*) FROM tasks WHERE message_id = 'lost-1' AND state = 'unknown'"
        " AND operator_since IS NOT NULL"
    )
    wait_for(lambda: count_rows(rig.db_a, waiting) == 1, "the outcome to wait for an operator")
    task_id = rig.task_id(rig.db_a, "erin", "lost-1")
    _login(page, rig)
    page.goto(f"{rig.console}/decisions?db=0")
    row = page.locator("#unknown-outcomes tr", has_text=task_id)
    row.locator("select[name=outcome]").select_option("done")
    row.locator("input[name=result]").fill('{"applied": "by hand"}')
    row.locator("input[name=note]").fill("seen on the target")
    row.locator("button.answer-button").click()
    page.wait_for_url(f"**/tasks/{task_id}?*")
    assert page.inner_text("#task-state") == "done"
    sent = f"SELECT count(*) FROM outbox WHERE task_id = '{task_id}' AND state = 'sent'"
    wait_for(lambda: count_rows(rig.db_a, sent) == 1, "its reply to be delivered")
    page.reload()
    assert "delivered" in page.inner_text("#reply-state")
    assert "by hand" in page.inner_text("#result")
    assert "by hand" in page.inner_text("#reply-body")
    log = page.inner_text("#reconcile-log")
    assert "alice (console)" in log
    assert "seen on the target" in log


def test_a_dead_letter_replayed_from_the_page_is_processed_once(page: Any, rig: Rig) -> None:
    client = connect(rig.redis_url)
    rig.publish(rig.prefix_a, "carol", "hold-1", {"hold": True})
    wait_for(lambda: _state_is(rig.db_a, "hold-1", "running"), "the holding task to run")
    rig.publish(
        rig.prefix_a, "carol", "second-1", {"effects_db": str(rig.effects_db), "value": "second"}
    )

    def quota_letters() -> list[dict[str, Any]]:
        return [
            e for e in dead_letter_entries(client, rig.prefix_a) if e["reason"] == "quota_exceeded"
        ]

    wait_for(lambda: len(quota_letters()) == 1, "the second request to be dead-lettered")
    assert count_rows(rig.db_a, "SELECT count(*) FROM tasks WHERE message_id = 'second-1'") == 0
    _login(page, rig)
    page.goto(f"{rig.console}/?db=0")
    assert "quota_exceeded" in page.inner_text("#dead-by-reason")
    # Free the quota: cancel the holding task from its page.
    page.goto(f"{rig.console}/tasks/{rig.task_id(rig.db_a, 'carol', 'hold-1')}?db=0")
    page.fill("form[action='/actions/cancel'] input[name=reason]", "make room")
    page.click("#cancel")
    wait_for(lambda: _state_is(rig.db_a, "hold-1", "cancelled"), "the holding task to stop")
    page.goto(f"{rig.console}/dead-letters?db=0")
    (letter,) = quota_letters()
    row = page.locator("#dead-entries tr", has_text=letter["entry_id"])
    assert "quota_exceeded" in row.inner_text()
    row.locator("button.replay-button").click()
    page.wait_for_url("**/dead-letters?*")
    assert "replayed" in page.inner_text(".note")
    wait_for(lambda: _state_is(rig.db_a, "second-1", "done"), "the replayed request to run")
    assert quota_letters() == []
    second = rig.task_id(rig.db_a, "carol", "second-1")
    assert count_rows(rig.db_a, "SELECT count(*) FROM tasks WHERE message_id = 'second-1'") == 1
    runs = f"SELECT count(*) FROM attempts WHERE task_id = '{second}'"
    assert count_rows(rig.effects_db, runs) == 1  # processed once
    # The same entry again: it is gone from the dead-letter stream, nothing is replayed.
    res = page.request.post(
        f"{rig.console}/actions/replay",
        form={"id": letter["entry_id"], "db": "0"},
        headers={"Authorization": f"Bearer {ALICE_TOKEN}"},
    )
    assert res.status == 409


def test_without_a_token_every_page_is_401_and_every_action_refused(page: Any, rig: Rig) -> None:
    rig.publish(rig.prefix_b, "frank", "restart-2", {"target": rig.target.url, "server": "web2"})
    wait_for(lambda: _state_is(rig.db_b, "restart-2", "waiting_approval"), "the task to wait")
    task_id = rig.task_id(rig.db_b, "frank", "restart-2")
    for path in (*PAGES, f"/tasks/{task_id}?db=1", "/decisions?db=1"):
        res = page.goto(f"{rig.console}{path}")
        assert res.status == 401, path
        body = page.content()
        assert task_id not in body
        assert "frank" not in body
    for path in ACTIONS:
        res = page.request.post(
            f"{rig.console}{path}", form={"task_id": task_id, "db": "1", "outcome": "done"}
        )
        assert res.status == 401, path
    # Signed in, a form posted without the session's CSRF token is refused too.
    _login(page, rig)
    res = page.request.post(f"{rig.console}/actions/approve", form={"task_id": task_id, "db": "1"})
    assert res.status == 403
    res = page.request.post(
        f"{rig.console}/actions/approve",
        form={"task_id": task_id},
        headers={"Authorization": "Bearer grafana-token-0123456789"},
    )
    assert res.status == 403  # a read-only token
    assert _state_is(rig.db_b, "restart-2", "waiting_approval")


def test_a_payload_containing_html_is_shown_as_text(page: Any, rig: Rig) -> None:
    markup = "<script>window.pwned = 1</script><img src=x onerror='window.pwned = 2'>"
    rig.publish(
        rig.prefix_a,
        "mallory",
        "html-1",
        {
            "effects_db": str(rig.effects_db),
            "value": markup,
            "api_key": "hunter2-not-shown",
        },
    )
    wait_for(lambda: _state_is(rig.db_a, "html-1", "done"), "the task to be done")
    _login(page, rig)
    page.goto(f"{rig.console}/tasks?db=0&principal=mallory")
    page.click("#task-list a")
    shown = page.inner_text("#payload")
    assert markup in shown
    assert markup in page.inner_text("#result")
    assert page.locator("#payload script, #payload img, #result img").count() == 0
    assert page.evaluate("typeof window.pwned") == "undefined"
    assert "hunter2" not in page.content()


def test_a_screenshot_of_the_pipeline_page_is_saved(page: Any, rig: Rig) -> None:
    """Last in the module: every stage has something to show by now."""
    rig.publish(rig.prefix_a, "alice", "hello-2", {"effects_db": str(rig.effects_db)})
    wait_for(lambda: _state_is(rig.db_a, "hello-2", "done"), "the task to be done")
    _login(page, rig)
    page.goto(f"{rig.console}/?db=0")
    groups = page.inner_text("#groups")
    for principal in ("alice", "carol", "erin", "mallory"):
        assert principal in groups
    rig.shots.mkdir(parents=True, exist_ok=True)
    shot = rig.shots / "pipeline.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 10_000
    extra = os.environ.get("BA_CONSOLE_SCREENSHOT")  # how docs/console.png is made
    if extra:
        shutil.copy(shot, extra)
