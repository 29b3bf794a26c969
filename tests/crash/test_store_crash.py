"""Every commit window of the store, killed for real.

Each case prepares a database, then runs ONE store operation in a child process armed with
``BA_CRASHPOINT=store.<op>.before_commit`` or ``...after_commit``. The child must die by
SIGKILL. Reopened in this process, the database must then hold:

* before_commit: exactly what it held before (every row of every table compared);
* after_commit: the whole effect, checked twice: against the operation's specific
  expectations, and row for row against the same operation run to completion in-process
  on a copy of the database (so a crash after COMMIT loses nothing and adds nothing).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.protocol.canonical import canonical_json, sha256_hex
from broker_adapter.protocol.reply import reply_id_for
from broker_adapter.store import Database, open_database
from tests.support.postgres import STORE_BACKENDS, ThrowawayDatabase, require_server
from tests.support.store_script import (
    LEASE_S,
    RETENTION_S,
    T0,
    Dump,
    Stores,
    create_effects_table,
    dump,
    dump_path,
    envelope_fields,
    item,
    open_any,
    run_op,
    stores,
)

pytestmark = pytest.mark.crash

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Prepared:
    """What a case's setup hands to the operation and to its check."""

    now: float
    args: dict[str, Any]
    ids: dict[str, str] = field(default_factory=dict)


Setup = Callable[[Stores, FakeClock], Prepared]
Check = Callable[[Dump, Dump, Prepared], None]


@dataclass(frozen=True)
class Case:
    name: str
    op: str
    setup: Setup
    check_after: Check


def run_child(
    db_path: str | Path, now: float, op: str, args: dict[str, Any], point: str | None
) -> Any:
    env = {k: v for k, v in os.environ.items() if k not in ("BA_CRASHPOINT", "BA_PAUSEPOINT")}
    if point is not None:
        env["BA_CRASHPOINT"] = point
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.support.store_script",
            "op",
            str(db_path),
            repr(now),
            op,
            json.dumps(args),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def one(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    found = [r for r in rows if all(r[k] == v for k, v in match.items())]
    assert len(found) == 1, f"expected exactly one row matching {match}, got {found}"
    return found[0]


def body(row: dict[str, Any]) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(row["body"])
    return value


# -- setups ---------------------------------------------------------------------------------


def accepted(s: Stores, mid: str = "m1", **overrides: Any) -> str:
    (res,) = s.tasks.accept([item(mid, **overrides)])
    assert res.task_id is not None
    return res.task_id


def claimed(s: Stores, owner: str = "w1") -> tuple[str, int]:
    task_id = accepted(s)
    (task,) = s.tasks.claim(owner)
    return task_id, task.fence


def finished(s: Stores) -> str:
    task_id, fence = claimed(s)
    return s.tasks.finish(task_id, "w1", fence, {"answer": 42})


def reply_claimed(s: Stores) -> tuple[str, int]:
    reply_id = finished(s)
    (row,) = s.outbox.claim("d1", 1)
    return reply_id, row.fence


def setup_accept(s: Stores, clock: FakeClock) -> Prepared:
    return Prepared(T0, {"principal": "alice", "envelope": envelope_fields("m1")})


def setup_accept_expired(s: Stores, clock: FakeClock) -> Prepared:
    fields = envelope_fields("m1", deadline=T0 - 1.0)
    return Prepared(T0, {"principal": "alice", "envelope": fields})


def setup_accept_conflict(s: Stores, clock: FakeClock) -> Prepared:
    task_id = accepted(s)
    fields = envelope_fields("m1", payload={"q": "other"})
    return Prepared(T0 + 1, {"principal": "alice", "envelope": fields}, {"task": task_id})


def setup_claim(s: Stores, clock: FakeClock) -> Prepared:
    return Prepared(T0 + 1, {"owner": "w1"}, {"task": accepted(s)})


def setup_finish(s: Stores, clock: FakeClock) -> Prepared:
    task_id, fence = claimed(s)
    args = {"task_id": task_id, "owner": "w1", "fence": fence, "result": {"answer": 42}}
    return Prepared(T0 + 1, args, {"task": task_id})


def setup_fail(retryable: bool) -> Setup:
    def setup(s: Stores, clock: FakeClock) -> Prepared:
        task_id, fence = claimed(s)
        args = {
            "task_id": task_id,
            "owner": "w1",
            "fence": fence,
            "error": "boom",
            "retryable": retryable,
        }
        return Prepared(T0 + 1, args, {"task": task_id})

    return setup


def setup_cancel(s: Stores, clock: FakeClock) -> Prepared:
    task_id, _ = claimed(s)
    return Prepared(T0 + 1, {"task_id": task_id}, {"task": task_id})


def setup_renew(s: Stores, clock: FakeClock) -> Prepared:
    task_id, fence = claimed(s)
    return Prepared(T0 + 10, {"task_id": task_id, "owner": "w1", "fence": fence}, {"task": task_id})


def setup_reconcile(s: Stores, clock: FakeClock) -> Prepared:
    task_id, _ = claimed(s)
    return Prepared(T0 + LEASE_S + 1, {}, {"task": task_id})


def setup_purge(s: Stores, clock: FakeClock) -> Prepared:
    reply_id, fence = reply_claimed(s)
    s.outbox.mark_sent(reply_id, "d1", fence, "1-1")
    live = accepted(s, "live", deadline=T0 + RETENTION_S)  # stays: not terminal
    return Prepared(T0 + RETENTION_S + 1, {}, {"reply": reply_id, "live": live})


def setup_outbox_claim(s: Stores, clock: FakeClock) -> Prepared:
    return Prepared(T0 + 1, {"owner": "d1"}, {"reply": finished(s)})


def setup_mark_sent(s: Stores, clock: FakeClock) -> Prepared:
    reply_id, fence = reply_claimed(s)
    args = {"reply_id": reply_id, "owner": "d1", "fence": fence, "entry_id": "1700-0"}
    return Prepared(T0 + 1, args, {"reply": reply_id})


def setup_reply_failure(s: Stores, clock: FakeClock) -> Prepared:
    reply_id, fence = reply_claimed(s)
    args = {"reply_id": reply_id, "owner": "d1", "fence": fence, "error": "redis down"}
    return Prepared(T0 + 1, args, {"reply": reply_id})


def setup_reply_replay(s: Stores, clock: FakeClock) -> Prepared:
    reply_id, fence = reply_claimed(s)
    s.outbox.mark_dead(reply_id, "d1", fence, "redis down")
    return Prepared(T0 + 5, {"reply_id": reply_id, "by": "ops-carol"}, {"reply": reply_id})


def setup_receipt(s: Stores, clock: FakeClock) -> Prepared:
    create_effects_table(s.db)
    data = canonical_json({"reply_id": "r-abc", "task_id": "abc", "status": "done", "v": 1})
    args = {
        "reply_id": "r-abc",
        "content_hash": sha256_hex(data),
        "principal": "alice",
        "body": data.decode("utf-8"),
    }
    return Prepared(T0 + 1, args, {"reply": "r-abc"})


# -- after_commit checks --------------------------------------------------------------------


def check_accept(before: Dump, after: Dump, p: Prepared) -> None:
    task = one(after["tasks"], message_id="m1", principal="alice")
    assert task["state"] == "pending"
    assert (task["attempts"], task["fence"], task["deadline"]) == (0, 0, T0 + 600)
    inbox = one(after["inbox"], message_id="m1", principal="alice")
    assert inbox["task_id"] == task["task_id"]
    assert after["outbox"] == []


def check_accept_expired(before: Dump, after: Dump, p: Prepared) -> None:
    task = one(after["tasks"], message_id="m1")
    assert task["state"] == "expired"
    reply = one(after["outbox"], task_id=task["task_id"])
    assert (reply["status"], reply["reply_id"]) == ("expired", reply_id_for(task["task_id"]))
    assert len(after["inbox"]) == 1


def check_accept_conflict(before: Dump, after: Dump, p: Prepared) -> None:
    assert after["tasks"] == before["tasks"]  # the stored request is untouched
    assert one(after["inbox"], message_id="m1")["conflicts"] == 1
    reply = one(after["outbox"], status="conflict")
    assert reply["task_id"] is None
    assert body(reply)["task_id"] == p.ids["task"]


def check_claim(before: Dump, after: Dump, p: Prepared) -> None:
    task = one(after["tasks"], task_id=p.ids["task"])
    assert (task["state"], task["owner"], task["attempts"], task["fence"]) == (
        "running",
        "w1",
        1,
        1,
    )
    assert task["lease_until"] == p.now + LEASE_S


def check_finish(before: Dump, after: Dump, p: Prepared) -> None:
    task = one(after["tasks"], task_id=p.ids["task"])
    assert task["state"] == "done"
    assert task["owner"] is None
    reply = one(after["outbox"], task_id=p.ids["task"])
    assert len(after["outbox"]) == 1
    assert body(reply)["result"] == {"answer": 42}
    assert (reply["status"], reply["state"]) == ("done", "pending")


def check_fail_retry(before: Dump, after: Dump, p: Prepared) -> None:
    task = one(after["tasks"], task_id=p.ids["task"])
    assert (task["state"], task["owner"], task["attempts"]) == ("pending", None, 1)
    assert p.now < task["not_before"] <= p.now + 1.0  # first retry: base 1 s
    assert task["error"] == "boom"
    assert after["outbox"] == []


def check_fail_final(before: Dump, after: Dump, p: Prepared) -> None:
    task = one(after["tasks"], task_id=p.ids["task"])
    assert task["state"] == "failed"
    reply = one(after["outbox"], task_id=p.ids["task"])
    assert body(reply)["error"] == "boom"


def check_cancel(before: Dump, after: Dump, p: Prepared) -> None:
    task = one(after["tasks"], task_id=p.ids["task"])
    assert task["state"] == "cancelled"
    assert one(after["outbox"], task_id=p.ids["task"])["status"] == "cancelled"


def check_renew(before: Dump, after: Dump, p: Prepared) -> None:
    task = one(after["tasks"], task_id=p.ids["task"])
    assert task["state"] == "running"
    assert task["lease_until"] == p.now + LEASE_S


def check_reconcile(before: Dump, after: Dump, p: Prepared) -> None:
    task = one(after["tasks"], task_id=p.ids["task"])
    assert (task["state"], task["owner"], task["attempts"]) == ("pending", None, 1)
    assert after["outbox"] == []


def check_purge(before: Dump, after: Dump, p: Prepared) -> None:
    # The whole request went (record, task, reply); the live one is untouched.
    assert len(before["inbox"]) == 2
    assert [r["task_id"] for r in after["inbox"]] == [p.ids["live"]]
    assert [r["task_id"] for r in after["tasks"]] == [p.ids["live"]]
    assert after["outbox"] == []


def check_outbox_claim(before: Dump, after: Dump, p: Prepared) -> None:
    row = one(after["outbox"], reply_id=p.ids["reply"])
    assert (row["state"], row["owner"], row["attempts"], row["fence"]) == ("sending", "d1", 1, 1)


def check_mark_sent(before: Dump, after: Dump, p: Prepared) -> None:
    row = one(after["outbox"], reply_id=p.ids["reply"])
    assert (row["state"], row["entry_id"], row["sent_at"]) == ("sent", "1700-0", p.now)


def check_reply_retry(before: Dump, after: Dump, p: Prepared) -> None:
    row = one(after["outbox"], reply_id=p.ids["reply"])
    assert (row["state"], row["last_error"], row["owner"]) == ("pending", "redis down", None)
    assert row["not_before"] > p.now


def check_reply_dead(before: Dump, after: Dump, p: Prepared) -> None:
    row = one(after["outbox"], reply_id=p.ids["reply"])
    assert (row["state"], row["last_error"]) == ("dead", "redis down")


def check_reply_replay(before: Dump, after: Dump, p: Prepared) -> None:
    row = one(after["outbox"], reply_id=p.ids["reply"])
    assert (row["state"], row["attempts"], row["replays"]) == ("pending", 0, 1)
    assert (row["replayed_by"], row["replayed_at"]) == ("ops-carol", p.now)


def check_receipt(before: Dump, after: Dump, p: Prepared) -> None:
    receipt = one(after["receipts"], reply_id="r-abc")
    assert receipt["effects"] == 1
    assert after["effects"] == [{"reply_id": "r-abc", "status": "done"}]


CASES = [
    Case("accept", "accept", setup_accept, check_accept),
    Case("accept_expired", "accept", setup_accept_expired, check_accept_expired),
    Case("accept_conflict", "accept", setup_accept_conflict, check_accept_conflict),
    Case("claim", "claim", setup_claim, check_claim),
    Case("finish", "finish", setup_finish, check_finish),
    Case("fail_retryable", "fail", setup_fail(True), check_fail_retry),
    Case("fail_final", "fail", setup_fail(False), check_fail_final),
    Case("cancel", "cancel", setup_cancel, check_cancel),
    Case("renew", "renew", setup_renew, check_renew),
    Case("reconcile", "reconcile", setup_reconcile, check_reconcile),
    Case("purge", "purge", setup_purge, check_purge),
    Case("outbox_claim", "outbox_claim", setup_outbox_claim, check_outbox_claim),
    Case("mark_sent", "mark_sent", setup_mark_sent, check_mark_sent),
    Case("reply_retry", "reply_retry", setup_reply_failure, check_reply_retry),
    Case("reply_dead", "reply_dead", setup_reply_failure, check_reply_dead),
    Case("reply_replay", "reply_replay", setup_reply_replay, check_reply_replay),
    Case("receipt", "receipt", setup_receipt, check_receipt),
]


def normalized(d: Dump, before: Dump) -> str:
    """The dump as text, with task ids minted by the operation replaced by a placeholder
    (accept draws fresh random ids, so two runs differ only there)."""
    known = {r["task_id"] for r in before["tasks"]}
    checked: Dump = {**d, "outbox": []}
    for row in d["outbox"]:
        # The hash covers the body, which holds the task id: check it, then set it aside.
        assert row["content_hash"] == sha256_hex(row["body"])
        checked["outbox"].append({**row, "content_hash": "<checked>"})
    text = json.dumps(checked, sort_keys=True, default=repr)
    for i, row in enumerate(sorted(d["tasks"], key=lambda r: r["created_at"])):
        if row["task_id"] not in known:
            text = text.replace(row["task_id"], f"<new-task-{i}>")
    return text


def copy_db(src: Path, dst: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{src}{suffix}").exists():
            shutil.copyfile(f"{src}{suffix}", f"{dst}{suffix}")


class Copies:
    """The database a case runs on, and copies of it: SQLite files in ``tmp_path``, or
    throwaway PostgreSQL databases (a copy is ``CREATE DATABASE ... TEMPLATE``)."""

    def __init__(self, backend: str, tmp_path: Path) -> None:
        self.backend = backend
        self.tmp_path = tmp_path
        self.made: list[ThrowawayDatabase] = []
        if backend == "postgresql":
            require_server()
            self.made.append(ThrowawayDatabase())
            self.target = self.made[0].url
        else:
            self.target = str(tmp_path / "store.db")

    def copy(self) -> str:
        if self.backend == "postgresql":
            self.made.append(ThrowawayDatabase(template=self.made[0]))
            return self.made[-1].url
        reference = self.tmp_path / "reference.db"
        copy_db(Path(self.target), reference)
        return str(reference)

    def drop(self) -> None:
        for database in self.made:
            database.drop()


@pytest.fixture(params=STORE_BACKENDS)
def copies(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Copies]:
    made = Copies(request.param, tmp_path)
    yield made
    made.drop()


@pytest.mark.parametrize("window", ["before_commit", "after_commit"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_store_op_crash_leaves_all_or_nothing(case: Case, window: str, copies: Copies) -> None:
    clock = FakeClock(T0)
    with open_any(copies.target) as db:
        prepared = case.setup(stores(db, clock), clock)
        before = dump(db)

    # The reference: the same operation, run to completion on a copy.
    reference_target = copies.copy()
    run_op(reference_target, prepared.now, case.op, prepared.args)
    reference = dump_path(reference_target)
    assert reference != before, "the operation under test must change something"

    proc = run_child(
        copies.target, prepared.now, case.op, prepared.args, f"store.{case.op}.{window}"
    )
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""  # it never got to report a result

    with open_any(copies.target) as db:
        if isinstance(db, Database):
            assert db.integrity_check() == "ok"
        after = dump(db)
    if window == "before_commit":
        assert after == before
    else:
        case.check_after(before, after, prepared)
        assert normalized(after, before) == normalized(reference, before)


def test_store_script_runs_op_to_completion_when_unarmed(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    clock = FakeClock(T0)
    with open_database(path) as db:
        prepared = setup_finish(stores(db, clock), clock)
    proc = run_child(path, prepared.now, "finish", prepared.args, None)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == reply_id_for(prepared.ids["task"])
    after = dump_path(path)
    assert one(after["tasks"], task_id=prepared.ids["task"])["state"] == "done"
