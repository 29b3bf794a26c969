"""The purge killed for real, before and after the COMMIT of one of its batches, on
SQLite and on PostgreSQL.

A child process runs a whole purge pass (batches of 2) armed with
``BA_CRASHPOINT=store.purge.<window>@<n>``; reopened, the database must hold every batch
before the n-th gone whole, the n-th gone whole (after_commit) or untouched (before_commit),
and the rest untouched: never a task without its inbox record or the other way round.
Then the requests' ids, sent again, must be new requests expired at once, whether their
rows are still on file (past the window the inbox forgets them by the rule the purge
deletes by) or gone: never a task that runs again.
"""

from __future__ import annotations

import signal

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.store import Database, Outcome
from broker_adapter.store.settle import Settlement
from tests.crash.test_store_crash import run_child
from tests.support.store_script import (
    RETENTION_S,
    T0,
    Stores,
    apply_receipt,
    dump,
    item,
    open_any,
    stores,
)

pytestmark = pytest.mark.crash

MIDS = [f"m{i}" for i in range(5)]
LIMIT = 2


def _requests(s: Stores, clock: FakeClock) -> None:
    """Five requests done and replied, then one still running (past the purge and the
    checks after it): batches of 2, 2 and 1."""
    s.tasks.accept([item(mid) for mid in MIDS])
    claimed = s.tasks.claim("w1", 10)
    s.tasks.settle_batch([Settlement(t.task_id, "w1", t.fence, result="1") for t in claimed], "", 0)
    rows = s.outbox.claim("d1", 10)
    s.outbox.mark_sent_and_claim("d1", [(r.reply_id, r.fence, "1-0") for r in rows], 0)
    clock.set(T0 + 100)
    s.tasks.accept([item("live", deadline=T0 + 100 + RETENTION_S)])
    s.tasks.claim("w2", 1)


def _whole_or_absent(path: str) -> dict[str, bool]:
    """Per message id: whether its request is on file; asserts it is whole or absent."""
    with open_any(path) as db:
        if isinstance(db, Database):  # PostgreSQL's foreign keys are never off
            assert db.integrity_check() == "ok"
            with db.read() as c:
                assert c.execute("PRAGMA foreign_key_check").fetchall() == []
        d = dump(db)
    tasks = {t["message_id"]: t["task_id"] for t in d["tasks"]}
    inbox = {r["message_id"]: r["task_id"] for r in d["inbox"]}
    replies = {r["message_id"]: r["task_id"] for r in d["outbox"]}
    assert tasks == inbox, "a task without its inbox record, or a record without its task"
    assert {m: t for m, t in tasks.items() if m != "live"} == replies
    return {mid: mid in tasks for mid in [*MIDS, "live"]}


@pytest.mark.parametrize(
    ("window", "nth", "gone"),
    [
        ("before_commit", 1, 0),
        ("after_commit", 1, 2),
        ("before_commit", 2, 2),
        ("after_commit", 2, 4),
        ("before_commit", 3, 4),
        ("after_commit", 3, 5),
    ],
)
def test_purge_killed_in_a_batch_leaves_whole_requests_or_none(
    store_target: str, window: str, nth: int, gone: int
) -> None:
    path = store_target
    clock = FakeClock(T0)
    with open_any(path) as db:
        _requests(stores(db, clock), clock)
    now = T0 + RETENTION_S + 1
    point = f"store.purge.{window}@{nth}"
    proc = run_child(path, now, "purge", {"limit": LIMIT}, point)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)

    on_file = _whole_or_absent(path)
    assert on_file["live"]
    assert [mid for mid in MIDS if not on_file[mid]] == MIDS[:gone]  # oldest first

    clock.set(now)
    with open_any(path) as db:
        s = stores(db, clock)
        results = s.tasks.accept([item(mid) for mid in MIDS])
        assert [r.outcome for r in results] == [Outcome.EXPIRED] * len(MIDS)
        # nothing runs again (the live task, its lease expired, is claimed anew)
        assert [t.message_id for t in s.tasks.claim("w3", 10)] == ["live"]
    # A restarted purge finishes the pass: the requests still on file, whose records the
    # expired ones took over, go; left are the expired ones (inside their window) and live.
    proc = run_child(path, now, "purge", {"limit": LIMIT}, None)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == 5 - gone
    assert all(_whole_or_absent(path).values())


@pytest.mark.parametrize("window", ["before_commit", "after_commit"])
def test_receipt_purge_killed_in_a_batch_keeps_or_removes_whole_batches(
    store_target: str, window: str
) -> None:
    path = store_target
    clock = FakeClock(T0)
    with open_any(path) as db:
        s = stores(db, clock)
        for i in range(3):
            apply_receipt(
                s.receipts,
                reply_id=f"r-{i}",
                content_hash="h",
                principal="alice",
                body=b'{"reply_id": "r"}',
                effect=None,
            )
    proc = run_child(
        path, T0 + RETENTION_S, "purge_receipts", {"limit": 2}, f"store.purge.{window}@1"
    )
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    with open_any(path) as db:
        if isinstance(db, Database):
            assert db.integrity_check() == "ok"
        left = [r["reply_id"] for r in dump(db)["receipts"]]
    assert left == (["r-0", "r-1", "r-2"] if window == "before_commit" else ["r-2"])
