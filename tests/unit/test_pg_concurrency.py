"""Two sessions on one PostgreSQL database at once: what the single SQLite writer gave by
turns, the row locks and identity locks give here.

Session A is held inside its transaction, just before COMMIT (its ``before_commit`` crash
point, patched to wait), while session B runs the same kind of operation; the test waits
for B to be blocked on a lock (``pg_locks``) or done, never for time to pass.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from broker_adapter import crashpoints
from broker_adapter.clock import FakeClock
from broker_adapter.errors import FencedError, TaskCancelled
from broker_adapter.protocol.canonical import canonical_json, sha256_hex
from broker_adapter.protocol.reply import Reply
from broker_adapter.store import Outcome, ReceiptOutcome, TaskState
from broker_adapter.store.approvals import ApprovalStore
from broker_adapter.store.effects import EffectsStore
from broker_adapter.store.postgres import PgDatabase
from broker_adapter.store.receipts import ReceiptItem
from broker_adapter.store.settle import Settlement
from tests.support.cli import wait_for
from tests.support.store_script import (
    OUTBOX_LEASE_S,
    T0,
    Stores,
    apply_receipt,
    create_effects_table,
    dump,
    item,
    stores,
)

HOLD_S = 30.0


@pytest.fixture
def two(pg_url: str) -> Iterator[tuple[Stores, Stores]]:
    """Two processes' worth of stores: two pools on one database, one shared fake time."""
    clock = FakeClock(T0)
    a, b = PgDatabase(pg_url), PgDatabase(pg_url)
    yield stores(a, clock), stores(b, clock, seed=1)
    a.close()
    b.close()


class Held:
    """Runs ``op`` in a thread whose transaction ``op_name`` waits before its COMMIT until
    ``release``; other threads pass the crash points untouched."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, op_name: str) -> None:
        self.at_commit = threading.Event()
        self.go = threading.Event()
        self.result: Any = None
        self.thread: threading.Thread | None = None
        point = f"store.{op_name}.before_commit"
        real = crashpoints.hit

        def hit(name: str) -> None:
            if name == point and threading.current_thread() is self.thread:
                self.at_commit.set()
                assert self.go.wait(HOLD_S), "never released"
            real(name)

        monkeypatch.setattr(crashpoints, "hit", hit)

    def start(self, op: Callable[[], Any]) -> None:
        def run() -> None:
            self.result = op()

        self.thread = threading.Thread(target=run, name="held")
        self.thread.start()
        assert self.at_commit.wait(HOLD_S), "the held transaction never reached its COMMIT"

    def release(self) -> Any:
        self.go.set()
        assert self.thread is not None
        self.thread.join(HOLD_S)
        assert not self.thread.is_alive()
        return self.result


def waiting_on_a_lock(url: str) -> bool:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM pg_locks WHERE NOT granted").fetchone()
    return row is not None and row[0] > 0


def in_thread(op: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(op()))
    thread.start()
    return thread, out


def test_two_sessions_accepting_one_request_store_it_once(
    two: tuple[Stores, Stores], pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A takeover delivers one envelope to two processes: the second waits on the
    identity's lock, then finds the first's record: duplicate, one task."""
    a, b = two
    held = Held(monkeypatch, "accept")
    held.start(lambda: a.tasks.accept([item("m1")]))
    thread, out = in_thread(lambda: b.tasks.accept([item("m1")]))
    wait_for(lambda: waiting_on_a_lock(pg_url), "the second accept to wait on the first")
    (first,) = held.release()
    thread.join(HOLD_S)
    ((second,),) = out
    assert (first.outcome, second.outcome) == (Outcome.STORED, Outcome.DUPLICATE)
    assert second.task_id == first.task_id
    d = dump(a.db)
    assert len(d["tasks"]) == len(d["inbox"]) == 1
    assert d["inbox"][0]["duplicates"] == 1


def test_a_claim_skips_the_rows_another_session_is_claiming(
    two: tuple[Stores, Stores], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers claim at once: neither waits for the other, neither gets the other's."""
    a, b = two
    a.tasks.accept([item("m1"), item("m2")])
    held = Held(monkeypatch, "claim")
    held.start(lambda: a.tasks.claim("wa", 1))
    got_b = b.tasks.claim("wb", 5)  # not blocked: the held row is skipped
    (got_a,) = held.release()
    assert len(got_b) == 1
    assert got_a.task_id != got_b[0].task_id
    assert b.tasks.claim("wb", 5) == []
    owners = sorted(r["owner"] for r in dump(a.db)["tasks"])
    assert owners == ["wa", "wb"]


def replies(s: Stores, *message_ids: str) -> None:
    """Pending replies in ``s``'s outbox, one per message id (reply id ``r-<id>``)."""
    with s.db.write("accept") as c:
        for mid in message_ids:
            body = {"m": mid}
            assert s.enqueue(
                c,
                reply_id=f"r-{mid}",
                task_id=None,
                principal="alice",
                message_id=mid,
                status="conflict",
                body=body,
                now=T0,
            )


def test_an_outbox_claim_skips_the_replies_another_session_is_claiming(
    two: tuple[Stores, Stores], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two dispatchers claim at once: neither waits for the other, neither gets the other's."""
    a, b = two
    replies(a, "m1", "m2")
    held = Held(monkeypatch, "outbox_claim")
    held.start(lambda: a.outbox.claim("da", 1))
    got_b = b.outbox.claim("db", 5)  # not blocked: the held row is skipped
    (got_a,) = held.release()
    assert len(got_b) == 1
    assert got_a.reply_id != got_b[0].reply_id
    assert b.outbox.claim("db", 5) == []
    assert sorted(r["owner"] for r in dump(a.db)["outbox"]) == ["da", "db"]


def test_a_fenced_mark_sent_waits_for_a_takeover_and_is_then_refused(
    two: tuple[Stores, Stores], pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dispatcher whose lease ran out (by the other's clock) records its publication
    while another takes the reply back: the mark waits on the row, then re-checks it as the
    takeover left it (a newer fence) and writes nothing."""
    a, b = two
    later = stores(b.db, FakeClock(T0 + OUTBOX_LEASE_S + 1), seed=2)
    replies(a, "m1")
    (mine,) = a.outbox.claim("da", 1)
    held = Held(monkeypatch, "outbox_claim")
    held.start(lambda: later.outbox.claim("db", 1))

    def mark() -> Exception | None:
        try:
            a.outbox.mark_sent(mine.reply_id, "da", mine.fence, "1-0")
        except FencedError as exc:
            return exc
        return None

    thread, out = in_thread(mark)
    wait_for(lambda: waiting_on_a_lock(pg_url), "the mark to wait on the takeover")
    (taken,) = held.release()
    thread.join(HOLD_S)
    (refused,) = out
    assert isinstance(refused, FencedError)
    assert taken.fence == mine.fence + 1
    (r,) = dump(a.db)["outbox"]
    assert (r["state"], r["owner"], r["fence"], r["entry_id"]) == ("sending", "db", 2, None)


def test_a_claim_skips_a_reply_being_marked_sent(
    two: tuple[Stores, Stores], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The takeover comes second: its claim skips the row the mark holds (no wait), and
    the publication the first dispatcher confirmed is recorded."""
    a, b = two
    later = stores(b.db, FakeClock(T0 + OUTBOX_LEASE_S + 1), seed=2)
    replies(a, "m1")
    (mine,) = a.outbox.claim("da", 1)
    held = Held(monkeypatch, "mark_sent")
    held.start(lambda: a.outbox.mark_sent(mine.reply_id, "da", mine.fence, "1-0"))
    assert later.outbox.claim("db", 1) == []  # not blocked: the held row is skipped
    held.release()
    (r,) = dump(a.db)["outbox"]
    assert (r["state"], r["owner"], r["fence"], r["entry_id"]) == ("sent", None, 1, "1-0")


def test_a_fenced_commit_waits_for_a_cancel_and_is_then_refused(
    two: tuple[Stores, Stores], pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator cancels a task while its worker commits the result: the worker's fenced
    UPDATE waits on the row, then re-checks it as the cancel left it and writes nothing.
    One terminal state, one reply: the cancel's."""
    a, b = two
    a.tasks.accept([item("m1")])
    (task,) = a.tasks.claim("wa", 1)
    held = Held(monkeypatch, "cancel")
    held.start(lambda: b.tasks.cancel(task.task_id, "operator"))
    late = Settlement(task.task_id, "wa", task.fence, result="1")
    thread, out = in_thread(lambda: a.tasks.settle_batch([late], "", 0))
    wait_for(lambda: waiting_on_a_lock(pg_url), "the commit to wait on the cancel")
    assert held.release() == "cancelled"
    thread.join(HOLD_S)
    ((refusal,),) = [batch.results for batch in out]
    assert isinstance(refusal, TaskCancelled)
    (reply,) = dump(a.db)["outbox"]
    assert reply["status"] == "cancelled"


def test_two_receivers_applying_one_reply_run_its_effect_once(
    two: tuple[Stores, Stores], pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = two
    create_effects_table(a.db)
    body = canonical_json({"v": 1, "reply_id": "r-1", "task_id": "t1", "status": "done"})
    reply = ReceiptItem("r-1", sha256_hex(body), "alice", body)
    calls: list[str] = []

    def effect(conn: Any, value: Reply) -> Any:
        calls.append(threading.current_thread().name)
        conn.execute("INSERT INTO effects (reply_id, status) VALUES (%s, %s)", ("r-1", "done"))
        return None

    held = Held(monkeypatch, "receipt")
    held.start(lambda: a.receipts.apply_many([reply], effect))
    thread, out = in_thread(lambda: b.receipts.apply_many([reply], effect))
    wait_for(lambda: waiting_on_a_lock(pg_url), "the second receiver to wait on the first")
    (first,) = held.release()
    thread.join(HOLD_S)
    ((second,),) = out
    assert (first.outcome, second.outcome) == (ReceiptOutcome.APPLIED, ReceiptOutcome.DUPLICATE)
    assert calls == ["held"]
    assert len(dump(a.db)["effects"]) == 1


# -- effects: reconciles and approval waits, several processes ------------------------------

RECONCILE_LEASE_S = 20.0


def unknown_tasks(s: Stores, n: int) -> list[str]:
    """``n`` tasks whose worker timed out after their effect started, oldest first."""
    fx = EffectsStore(s.tasks.tx)
    ids = []
    for i in range(n):
        s.tasks.accept([item(f"m{i}")])
        (task,) = s.tasks.claim("w1", 1)
        fx.mark_effect_started(task.task_id, "w1", task.fence)
        fx.to_unknown(task.task_id, "w1", task.fence, "timed out")
        ids.append(task.task_id)
    return ids


def test_two_reconcilers_claiming_at_once_take_each_unknown_task_once(
    two: tuple[Stores, Stores], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two adapters' reconcile threads claim at once: neither waits for the other's rows,
    neither gets them (``claim_unknown`` skips what another reconciler is taking)."""
    a, b = two
    ids = unknown_tasks(a, 3)
    held = Held(monkeypatch, "claim_unknown")
    held.start(lambda: EffectsStore(a.tasks.tx).claim_unknown("ra", 1, RECONCILE_LEASE_S))
    got_b = EffectsStore(b.tasks.tx).claim_unknown("rb", 5, RECONCILE_LEASE_S)  # not blocked
    (got_a,) = held.release()
    assert got_a.task.task_id == ids[0]  # the oldest due, taken by the held one
    assert sorted(c.task.task_id for c in got_b) == sorted(ids[1:])
    assert EffectsStore(b.tasks.tx).claim_unknown("rb", 5, RECONCILE_LEASE_S) == []
    owners = {r["task_id"]: r["owner"] for r in dump(a.db)["tasks"]}
    assert owners == {ids[0]: "ra", ids[1]: "rb", ids[2]: "rb"}


def test_a_reconcile_answer_waits_for_an_operator_answer_and_is_then_fenced(
    two: tuple[Stores, Stores], pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator answers "not done" while the reconciler holding the task finds it done:
    the reconciler's check waits on the row lock, then sees the operator's fence and
    writes nothing. The task is pending again, with no reply."""
    a, b = two
    (task_id,) = unknown_tasks(a, 1)
    (claim,) = EffectsStore(a.tasks.tx).claim_unknown("ra", 1, RECONCILE_LEASE_S)
    held = Held(monkeypatch, "reconcile_operator")
    held.start(lambda: EffectsStore(b.tasks.tx).operator_resolve(task_id, "not-done", "alice"))
    fx = EffectsStore(a.tasks.tx)
    thread, out = in_thread(
        lambda: _raised(lambda: fx.resolve_done(task_id, "ra", claim.task.fence, 1))
    )
    wait_for(lambda: waiting_on_a_lock(pg_url), "the reconcile answer to wait on the operator's")
    assert held.release() is TaskState.PENDING
    thread.join(HOLD_S)
    (refusal,) = out
    assert isinstance(refusal, FencedError)
    d = dump(a.db)
    assert (d["tasks"][0]["state"], d["outbox"]) == ("pending", [])
    assert [r.by_whom for r in fx.reconcile_log(task_id)] == ["alice"]


def test_two_releases_of_one_approval_wait_release_it_once(
    two: tuple[Stores, Stores], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two adapters release approval waits at once: the second skips the wait the first is
    releasing, so a task it sent back to ``pending`` (and a worker may have claimed since)
    is never set again."""
    a, b = two
    a.tasks.accept([item("m1")])
    (task,) = a.tasks.claim("w1", 1)
    ApprovalStore(a.tasks.tx).wait_for_approval(
        task.task_id,
        "w1",
        task.fence,
        "restart",
        "web1",
        "prod",
        120,
        principal="alice",
        arguments_digest="d" * 64,
    )
    ApprovalStore(a.tasks.tx).grant_approval(
        "restart", "web1", "prod", "carol", T0 + 60, principal="alice", arguments_digest="d" * 64
    )
    held = Held(monkeypatch, "approval_release")
    held.start(lambda: ApprovalStore(a.tasks.tx).release_waits())
    second = ApprovalStore(b.tasks.tx).release_waits()  # not blocked: the held wait is skipped
    assert held.release()["released"] == 1
    assert second == {"released": 0, "timed_out": 0, "dropped": 0}
    d = dump(a.db)
    assert d["tasks"][0]["state"] == "pending"
    assert ApprovalStore(b.tasks.tx).release_waits()["released"] == 0


def _raised(op: Callable[[], Any]) -> Any:
    """What ``op`` returned, or the exception it raised."""
    try:
        return op()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc


def test_a_reply_id_held_by_one_receiver_with_other_content_is_a_conflict_for_the_other(
    two: tuple[Stores, Stores], pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same reply id with another body at once: the second receiver waits on the
    first's insert, then refuses its own (conflict), keeping the first's receipt; it never
    runs its effect."""
    a, b = two
    create_effects_table(a.db)
    first_body = canonical_json({"v": 1, "reply_id": "r-1", "task_id": "t1", "status": "done"})
    other_body = canonical_json({"v": 1, "reply_id": "r-1", "task_id": "t1", "status": "failed"})
    calls: list[str] = []

    def effect(conn: Any, value: Reply) -> Any:
        calls.append(str(value.status))
        conn.execute("INSERT INTO effects (reply_id, status) VALUES (?, ?)", ("r-1", value.status))
        return None

    def apply(s: Stores, body: bytes) -> Any:
        return apply_receipt(
            s.receipts,
            reply_id="r-1",
            content_hash=sha256_hex(body),
            principal="alice",
            body=body,
            effect=effect,
        )

    held = Held(monkeypatch, "receipt")
    held.start(lambda: apply(a, first_body))
    thread, out = in_thread(lambda: apply(b, other_body))
    wait_for(lambda: waiting_on_a_lock(pg_url), "the second receiver to wait on the first")
    first_outcome, first = held.release()
    thread.join(HOLD_S)
    ((second_outcome, second),) = out
    assert (first_outcome, second_outcome) == (ReceiptOutcome.APPLIED, ReceiptOutcome.CONFLICT)
    assert second == first
    assert second.content_hash == sha256_hex(first_body)
    assert calls == ["done"]
    assert dump(a.db)["effects"] == [{"reply_id": "r-1", "status": "done"}]
    assert b.receipts.get("r-1") == first
