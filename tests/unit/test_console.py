"""The console's handlers without a browser (Starlette's TestClient): authentication,
CSRF, read-only tokens, each decision through the CLI's functions with the operator's
name, escaping, and the store reads on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import fakeredis
import pytest

pytest.importorskip("starlette")

from starlette.testclient import TestClient

from broker_adapter.clock import FakeClock
from broker_adapter.console.app import ConsoleConfig, create_app
from broker_adapter.console.auth import COOKIE, Csrf, Tokens
from broker_adapter.console.sources import REDACTED, Store
from broker_adapter.errors import ConfigError, StoreBusy
from broker_adapter.store import console_queries as q
from broker_adapter.store.approvals import ApprovalStore
from broker_adapter.store.effects import EffectsStore
from tests.support.store_script import Stores, item, open_any, stores

ALICE = "alice-token-0123456789abcdef"
GRAFANA = "grafana-token-0123456789abcdef"
PREFIX = "ba"


@pytest.fixture
def now_clock() -> FakeClock:
    """The store's clock at the wall clock's time: the console's own writes (an approval's
    expiry) are made on the wall clock."""
    return FakeClock(time.time())


@pytest.fixture
def s(store_target: str, now_clock: FakeClock) -> Iterator[Stores]:
    with open_any(store_target) as db:
        yield stores(db, now_clock)


def _tokens() -> Tokens:
    return Tokens.from_json_value(
        {"alice": ALICE, "grafana": {"token": GRAFANA, "read_only": True}}
    )


@pytest.fixture
def client(s: Stores) -> Iterator[TestClient]:
    redis = fakeredis.FakeRedis()
    config = ConsoleConfig(
        stores=[Store("adapter-1", s.db)],
        client=redis,
        prefix=PREFIX,
        tokens=_tokens(),
        csrf=Csrf(b"k" * 32),
    )
    with TestClient(create_app(config), base_url="http://127.0.0.1:8470") as tc:
        yield tc


#: What the waiting task of ``_waiting`` is bound to (its principal, its arguments' digest).
BOUND = {"principal": "alice", "arguments_digest": "d" * 64}


def _accept(s: Stores, mid: str, principal: str = "alice", **over: Any) -> str:
    deadline = s.tasks.clock.now() + 600
    (result,) = s.tasks.accept([item(mid, principal, sender=principal, deadline=deadline, **over)])
    assert result.task_id is not None
    return result.task_id


def _waiting(s: Stores, mid: str = "w1", payload: Any = None) -> str:
    task_id = _accept(s, mid, payload=payload or {"server": "web1"})
    (task,) = s.tasks.claim("w1")
    ApprovalStore(s.tasks.tx).wait_for_approval(
        task_id,
        "w1",
        task.fence,
        "apply",
        "web1",
        "restart",
        600,
        **BOUND,
        arguments='{"server":"web1"}',
    )
    return task_id


def _unknown(s: Stores, mid: str = "u1") -> str:
    task_id = _accept(s, mid)
    (task,) = s.tasks.claim("w1")
    fx = EffectsStore(s.tasks.tx)
    fx.mark_effect_started(task_id, "w1", task.fence)
    fx.to_unknown(task_id, "w1", task.fence, "timed out")
    return task_id


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _login(tc: TestClient) -> str:
    """Sign in through the login page; the session's CSRF token (read off a form)."""
    res = tc.post("/login", data={"token": ALICE}, follow_redirects=False)
    assert res.status_code == 303
    page = tc.get("/decisions").text
    marker = 'name="csrf" value="'
    return page[page.index(marker) + len(marker) :].split('"', 1)[0]


PAGES = ("/", "/tasks", "/decisions", "/dead-letters", "/tasks/t-any")
ACTIONS = (
    "/actions/approve",
    "/actions/deny",
    "/actions/reconcile",
    "/actions/cancel",
    "/actions/replay",
    "/logout",
)


# -- tokens ----------------------------------------------------------------------------------


def test_the_tokens_file_must_be_private_and_well_formed(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"alice": ALICE}))
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        Tokens.load(path)
    path.chmod(0o600)
    assert Tokens.load(path).find(ALICE) is not None
    for bad, why in (
        ([ALICE], "object of operators"),
        ({"alice": "short"}, "at least 16"),
        ({"alice": ALICE, "bob": ALICE}, "another operator's"),
        ({"alice": {"token": ALICE, "read_only": "yes"}}, "boolean"),
        ({"alice": 7}, "must be a token"),
        ({}, "no operator"),
    ):
        with pytest.raises(ConfigError, match=why):
            Tokens.from_json_value(bad)


def test_a_token_finds_its_operator_and_nothing_else_does() -> None:
    tokens = _tokens()
    alice, grafana = tokens.find(ALICE), tokens.find(GRAFANA)
    assert alice is not None
    assert (alice.name, alice.read_only) == ("alice", False)
    assert grafana is not None
    assert (grafana.name, grafana.read_only) == ("grafana", True)
    for other in (None, "", ALICE[:-1], ALICE + "x", ALICE.upper()):
        assert tokens.find(other) is None


def test_the_csrf_token_is_the_sessions_own() -> None:
    csrf = Csrf(b"k" * 32)
    mine = csrf.token_for(ALICE)
    assert csrf.check(ALICE, mine)
    assert not csrf.check(GRAFANA, mine)
    assert not csrf.check(ALICE, None)
    assert not csrf.check(ALICE, mine[:-1])
    assert not Csrf(b"j" * 32).check(ALICE, mine)  # another start of the console


# -- authentication --------------------------------------------------------------------------


def test_without_a_token_every_page_is_401_and_shows_no_data(client: TestClient, s: Stores) -> None:
    task_id = _waiting(s, "secret-mid")
    for path in (*PAGES, f"/tasks/{task_id}"):
        for headers in ({}, _bearer("not-a-token-at-all-000"), {"Authorization": ALICE}):
            res = client.get(path, headers=headers)
            assert res.status_code == 401, path
            assert "Bearer" in res.headers["www-authenticate"]
            assert task_id not in res.text
            assert "secret-mid" not in res.text
            assert "alice" not in res.text
    assert client.get("/login").status_code == 200


def test_without_a_token_every_action_is_refused_and_changes_nothing(
    client: TestClient, s: Stores
) -> None:
    task_id = _waiting(s)
    for path in ACTIONS:
        res = client.post(path, data={"task_id": task_id, "id": "1-1", "outcome": "done"})
        assert res.status_code == 401, path
    row = s.tasks.get(task_id)
    assert row is not None
    assert row.state == "waiting_approval"
    assert ApprovalStore(s.tasks.tx).counts()["approvals_valid"] == 0
    assert client.get("/actions/approve", headers=_bearer(ALICE)).status_code == 405


def test_the_login_page_sets_the_token_as_a_strict_httponly_cookie(client: TestClient) -> None:
    res = client.post("/login", data={"token": "wrong-token-0000000000"}, follow_redirects=False)
    assert res.status_code == 401
    assert "set-cookie" not in res.headers
    res = client.post("/login", data={"token": ALICE}, follow_redirects=False)
    assert (res.status_code, res.headers["location"]) == (303, "/")
    cookie = res.headers["set-cookie"].lower()
    assert f"{COOKIE}=" in cookie
    assert "httponly" in cookie
    assert "samesite=strict" in cookie
    page = client.get("/")
    assert page.status_code == 200
    assert "alice" in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY"


def test_a_cookie_session_needs_its_csrf_token(client: TestClient, s: Stores) -> None:
    task_id = _accept(s, "c1")
    csrf = _login(client)
    for forged in ({}, {"csrf": "0" * 64}, {"csrf": Csrf(b"j" * 32).token_for(ALICE)}):
        res = client.post("/actions/cancel", data={"task_id": task_id, **forged})
        assert res.status_code == 403
    row = s.tasks.get(task_id)
    assert row is not None
    assert row.state == "pending"
    res = client.post("/actions/cancel", data={"task_id": task_id, "csrf": csrf})
    assert res.status_code == 200  # followed to the task's page
    row = s.tasks.get(task_id)
    assert row is not None
    assert row.state == "cancelled"
    assert "[by alice (console)]" in (row.error or "")


def test_a_read_only_token_sees_the_pages_and_may_not_act(client: TestClient, s: Stores) -> None:
    task_id = _waiting(s)
    for path in (*PAGES[:-1], f"/tasks/{task_id}"):
        assert client.get(path, headers=_bearer(GRAFANA)).status_code == 200, path
    page = client.get("/decisions", headers=_bearer(GRAFANA)).text
    assert task_id in page
    assert "Approve</button>" not in page
    for path in ACTIONS[:-1]:
        res = client.post(path, data={"task_id": task_id}, headers=_bearer(GRAFANA))
        assert res.status_code == 403, path
    row = s.tasks.get(task_id)
    assert row is not None
    assert row.state == "waiting_approval"


# -- decisions -------------------------------------------------------------------------------


def test_approve_records_the_operator_and_the_task_page_shows_who_approved(
    client: TestClient, s: Stores, now_clock: FakeClock
) -> None:
    task_id = _waiting(s)
    res = client.post(
        "/actions/approve", data={"task_id": task_id, "expires_in": "60"}, headers=_bearer(ALICE)
    )
    assert res.status_code == 200, res.text
    approvals = ApprovalStore(s.tasks.tx)
    now_clock.set(time.time())  # the console granted it on the wall clock
    found = approvals.valid_approval(
        "apply", "web1", "restart", principal="alice", arguments_digest="d" * 64
    )
    assert found is not None
    assert found.approver == "alice (console)"
    assert found.expires_at == pytest.approx(time.time() + 60, abs=5)
    assert approvals.release_waits()["released"] == 1
    page = client.get(f"/tasks/{task_id}", headers=_bearer(ALICE)).text
    assert "alice (console)" in page
    assert "released by an approval" in page
    again = client.post("/actions/approve", data={"task_id": task_id}, headers=_bearer(ALICE))
    assert again.status_code == 409  # it waits no more


@pytest.mark.parametrize("expires_in", ["0", "-5", "soon"])
def test_an_approval_needs_a_positive_expiry(
    client: TestClient, s: Stores, expires_in: str
) -> None:
    task_id = _waiting(s)
    res = client.post(
        "/actions/approve",
        data={"task_id": task_id, "expires_in": expires_in},
        headers=_bearer(ALICE),
    )
    assert res.status_code in (400, 409)
    assert ApprovalStore(s.tasks.tx).counts()["approvals_valid"] == 0


def test_deny_cancels_the_waiting_task_under_the_operators_name(
    client: TestClient, s: Stores
) -> None:
    task_id = _waiting(s)
    res = client.post(
        "/actions/deny", data={"task_id": task_id, "reason": "not today"}, headers=_bearer(ALICE)
    )
    assert res.status_code == 200
    row = s.tasks.get(task_id)
    assert row is not None
    assert row.state == "cancelled"
    assert row.error is not None
    assert "approval denied: not today [by alice (console)]" in row.error
    assert ApprovalStore(s.tasks.tx).counts()["approvals_valid"] == 0


def test_an_unknown_outcome_answered_done_ends_done_with_the_observed_result(
    client: TestClient, s: Stores
) -> None:
    task_id = _unknown(s)
    page = client.get("/decisions", headers=_bearer(ALICE)).text
    assert task_id in page
    bad = client.post(
        "/actions/reconcile",
        headers=_bearer(ALICE),
        data={"task_id": task_id, "outcome": "done", "result": "{not json"},
    )
    assert bad.status_code == 409
    assert "not JSON" in bad.text
    res = client.post(
        "/actions/reconcile",
        headers=_bearer(ALICE),
        data={
            "task_id": task_id,
            "outcome": "done",
            "result": '{"applied": 1}',
            "note": "checked the target",
        },
    )
    assert res.status_code == 200
    story = q.task_story(s.db, task_id)
    assert story is not None
    assert story["task"]["state"] == "done"
    assert story["task"]["result"] == {"applied": 1}
    (log,) = story["reconcile_log"]
    assert (log["outcome"], log["by_whom"]) == ("done", "alice (console)")
    assert story["reply"]["body"]["result"] == {"applied": 1}
    assert not story["reply"]["delivered"]
    twice = client.post(
        "/actions/reconcile", headers=_bearer(ALICE), data={"task_id": task_id, "outcome": "done"}
    )
    assert twice.status_code == 409  # no longer unknown


def test_an_unknown_outcome_answered_not_done_is_retried(client: TestClient, s: Stores) -> None:
    task_id = _unknown(s)
    res = client.post(
        "/actions/reconcile",
        headers=_bearer(ALICE),
        data={"task_id": task_id, "outcome": "not-done"},
    )
    assert res.status_code == 200
    row = s.tasks.get(task_id)
    assert row is not None
    assert row.state == "pending"
    bad = client.post(
        "/actions/reconcile", headers=_bearer(ALICE), data={"task_id": task_id, "outcome": "maybe"}
    )
    assert bad.status_code == 400


# -- what a page shows -----------------------------------------------------------------------


def test_markup_in_a_payload_is_shown_as_text_and_secrets_are_not_shown(
    client: TestClient, s: Stores
) -> None:
    payload = {"note": "<script>alert(1)</script><b>bold</b>", "api_key": "hunter2-secret"}
    task_id = _waiting(s, "<i>mid</i>", payload=payload)
    for path in (f"/tasks/{task_id}", "/decisions", "/tasks"):
        page = client.get(path, headers=_bearer(ALICE)).text
        assert "<script>alert" not in page
        assert "<b>bold" not in page
        assert "<i>mid" not in page
        assert "hunter2-secret" not in page
    page = client.get(f"/tasks/{task_id}", headers=_bearer(ALICE)).text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert REDACTED in page


def test_the_pipeline_shows_the_stages_per_principal(client: TestClient, s: Stores) -> None:
    for i in range(3):
        _accept(s, f"a{i}", "alice")
    bob = _accept(s, "b0", "bob")
    (task,) = s.tasks.claim("w1", 1)
    s.tasks.finish(task.task_id, "w1", task.fence, {"ok": True})
    view = q.pipeline(s.db, s.tasks.clock.now())
    groups = {g.group: g for g in view.groups}
    assert set(groups) == {"alice", "bob"}
    done_by = "alice" if task.task_id != bob else "bob"
    assert groups[done_by].outcome == {"done": 1}
    assert groups["alice"].received == 3
    assert groups["bob"].received == 1
    assert sum(g.processing.get("pending", 0) for g in groups.values()) == 3
    assert groups[done_by].delivery == {"pending": 1}
    assert view.oldest_unsent is not None
    assert view.oldest_unsent["task_id"] == task.task_id
    with pytest.raises(ValueError, match="cannot group"):
        q.pipeline(s.db, 0.0, group_by="payload")
    page = client.get("/", headers=_bearer(ALICE))
    assert page.status_code == 200
    assert '<meta http-equiv="refresh"' in page.text
    assert client.get("/", params={"group": "payload"}, headers=_bearer(ALICE)).status_code == 400
    assert "bob" in page.text
    assert task.task_id in page.text


def test_search_by_each_field(client: TestClient, s: Stores) -> None:
    a = _accept(s, "m-a", "alice")
    b = _accept(s, "m-b", "bob")
    assert [r["task_id"] for r in q.search_tasks(s.db, message_id="m-b")] == [b]
    assert [r["task_id"] for r in q.search_tasks(s.db, principal="alice")] == [a]
    assert [r["task_id"] for r in q.search_tasks(s.db, task_id=a)] == [a]
    assert {r["task_id"] for r in q.search_tasks(s.db, state="pending")} == {a, b}
    assert q.search_tasks(s.db, state="done") == []
    assert len(q.search_tasks(s.db, limit=1)) == 1
    for bad in ({"state": "nope"}, {"limit": 0}, {"limit": q.LIST_LIMIT + 1}):
        with pytest.raises(ValueError, match=r"state|limit"):
            q.search_tasks(s.db, **bad)
    page = client.get("/tasks", params={"principal": "bob"}, headers=_bearer(ALICE)).text
    assert b in page
    assert a not in page
    assert client.get("/tasks", params={"state": "nope"}, headers=_bearer(ALICE)).status_code == 400
    assert client.get("/tasks/none-such", headers=_bearer(ALICE)).status_code == 404
    assert client.get("/", params={"db": "1"}, headers=_bearer(ALICE)).status_code == 404


class _StoreAway:
    """A store whose every read fails as a busy or unreachable database does."""

    def read(self) -> Any:
        raise StoreBusy("database is locked")


def test_a_store_that_does_not_answer_is_a_503_page_not_a_crash() -> None:
    away = cast(Any, _StoreAway())
    config = ConsoleConfig(
        stores=[Store("away", away)],
        client=fakeredis.FakeRedis(),
        prefix=PREFIX,
        tokens=_tokens(),
    )
    with TestClient(create_app(config)) as tc:
        for path in ("/", "/tasks", "/decisions", "/tasks/t1"):
            res = tc.get(path, headers=_bearer(ALICE))
            assert res.status_code == 503, path
            assert "database is locked" in res.text


def test_the_console_command_refuses_a_readable_tokens_file_a_missing_store_and_a_bad_port(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from broker_adapter.app.cli import main
    from broker_adapter.store import open_database

    open_database(tmp_path / "adapter.db").close()
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"alice": ALICE}))
    base = ["console", "--redis", "redis://127.0.0.1:1/0", "--tokens", str(tokens)]
    for mode, db, port, why in (
        (0o640, "adapter.db", "8470", "chmod 600"),
        (0o600, "missing.db", "8470", "no such database file"),
        (0o600, "adapter.db", "0", "not a TCP port"),
        (0o600, "adapter.db", "65536", "not a TCP port"),
    ):
        tokens.chmod(mode)
        code = main([*base, "--db", str(tmp_path / db), "--port", port])
        err = capsys.readouterr().err
        assert code == 2, err
        assert why in err
    assert not (tmp_path / "missing.db").exists()  # nothing was created
