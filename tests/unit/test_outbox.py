"""The transactional outbox: one reply per terminal task, fenced publication, dead and replay."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.errors import FencedError, StaleError
from broker_adapter.protocol.canonical import canonical_json, sha256_hex
from broker_adapter.store import OutboxRow, OutboxStore
from broker_adapter.store.outbox_types import UnknownReply
from broker_adapter.store.report import snapshot
from tests.support.store_script import (
    OUTBOX_BACKOFF,
    OUTBOX_LEASE_S,
    OUTBOX_MAX_ATTEMPTS,
    T0,
    Stores,
    dump,
    item,
    open_any,
    stores,
)


@pytest.fixture
def s(store_target: str, clock: FakeClock) -> Iterator[Stores]:
    with open_any(store_target) as db:
        yield stores(db, clock)


def finished(s: Stores, mid: str = "m1") -> str:
    (res,) = s.tasks.accept([item(mid)])
    assert res.task_id is not None
    (task,) = s.tasks.claim("w1")
    return s.tasks.finish(res.task_id, "w1", task.fence, {"mid": mid})


def row(s: Stores, reply_id: str) -> OutboxRow:
    found = s.outbox.get(reply_id)
    assert found is not None
    return found


def not_before(s: Stores, reply_id: str) -> float:
    ((value,),) = s.sql("SELECT not_before FROM outbox WHERE reply_id = ?", (reply_id,))
    return float(value)


def test_outbox_enqueue_stores_canonical_body_and_hash_once(s: Stores) -> None:
    body = {"b": 1, "a": "é"}
    with s.db.write("accept") as c:
        assert s.enqueue(
            c,
            reply_id="x1",
            task_id=None,
            principal="alice",
            message_id="m",
            status="conflict",
            body=body,
            now=T0,
        )
        assert not s.enqueue(
            c,
            reply_id="x1",
            task_id=None,
            principal="alice",
            message_id="m",
            status="conflict",
            body={"other": 1},
            now=T0,
        )
    r = row(s, "x1")
    assert r.body == canonical_json(body)
    assert r.content_hash == sha256_hex(r.body)
    assert (r.state, r.attempts, r.fence, r.created_at) == ("pending", 0, 0, T0)


def test_outbox_enqueue_refuses_second_reply_for_same_task(s: Stores) -> None:
    reply_id = finished(s)
    task_id = row(s, reply_id).task_id
    with s.db.write("finish") as c:
        assert not s.enqueue(
            c,
            reply_id="r-other",
            task_id=task_id,
            principal="alice",
            message_id="m1",
            status="done",
            body={},
            now=T0,
        )
    assert [r["reply_id"] for r in dump(s.db)["outbox"]] == [reply_id]


def test_outbox_claim_sets_owner_lease_attempts_and_fence(s: Stores, clock: FakeClock) -> None:
    reply_id = finished(s)
    clock.advance(1)
    (r,) = s.outbox.claim("d1", 10)
    assert (r.reply_id, r.state, r.owner, r.attempts, r.fence) == (reply_id, "sending", "d1", 1, 1)
    assert r.lease_until == T0 + 1 + OUTBOX_LEASE_S
    assert s.outbox.claim("d2", 10) == []


@pytest.mark.parametrize("n", [0, -1])
def test_outbox_claim_takes_nothing_when_n_below_one(s: Stores, n: int) -> None:
    finished(s, "m1")
    finished(s, "m2")
    before = dump(s.db)
    assert s.outbox.claim("d1", n) == []
    assert dump(s.db) == before


def test_outbox_claim_takes_at_most_n_oldest_first(s: Stores, clock: FakeClock) -> None:
    ids = []
    for n in range(3):
        ids.append(finished(s, f"m{n}"))
        clock.advance(1)
    assert [r.reply_id for r in s.outbox.claim("d1", 2)] == ids[:2]
    assert [r.reply_id for r in s.outbox.claim("d1", 2)] == ids[2:]


def test_outbox_claim_takes_back_row_whose_lease_expired(s: Stores, clock: FakeClock) -> None:
    reply_id = finished(s)
    (first,) = s.outbox.claim("d1", 1)
    clock.advance(OUTBOX_LEASE_S - 0.001)
    assert s.outbox.claim("d2", 1) == []
    clock.advance(0.001)
    (second,) = s.outbox.claim("d2", 1)
    assert (second.owner, second.attempts, second.fence) == ("d2", 2, first.fence + 1)
    assert second.body == first.body  # same reply id, same bytes on every resend
    before = dump(s.db)
    with pytest.raises(FencedError) as info:
        s.outbox.mark_sent(reply_id, "d1", first.fence, "9-9")
    assert (info.value.reason, info.value.token, info.value.current) == ("fence", 1, 2)
    assert dump(s.db) == before


def test_outbox_mark_sent_records_entry_and_time(s: Stores, clock: FakeClock) -> None:
    reply_id = finished(s)
    (r,) = s.outbox.claim("d1", 1)
    clock.advance(2)
    s.outbox.mark_sent(reply_id, "d1", r.fence, "1700000000000-0")
    sent = row(s, reply_id)
    assert (sent.state, sent.owner, sent.lease_until) == ("sent", None, None)
    assert (sent.entry_id, sent.sent_at, sent.last_error) == ("1700000000000-0", T0 + 2, None)
    assert s.outbox.claim("d1", 1) == []


def held(s: Stores, clock: FakeClock) -> tuple[str, int]:
    reply_id = finished(s)
    (r,) = s.outbox.claim("d1", 1)
    return reply_id, r.fence


@pytest.mark.parametrize("op", ["mark_sent", "retry", "mark_dead"])
@pytest.mark.parametrize("reason", ["lease_expired", "owner", "not_sending", "fence"])
def test_outbox_fenced_write_is_refused_and_writes_nothing_when_stale(
    s: Stores, clock: FakeClock, op: str, reason: str
) -> None:
    reply_id, fence = held(s, clock)
    owner = "d1"
    if reason == "lease_expired":
        clock.advance(OUTBOX_LEASE_S)
    elif reason == "owner":
        owner = "mallory"
    elif reason == "not_sending":
        s.outbox.mark_sent(reply_id, "d1", fence, "1-0")
    else:
        fence -= 1
    calls: dict[str, Callable[[], object]] = {
        "mark_sent": lambda: s.outbox.mark_sent(reply_id, owner, fence, "2-0"),
        "retry": lambda: s.outbox.retry(reply_id, owner, fence, "late"),
        "mark_dead": lambda: s.outbox.mark_dead(reply_id, owner, fence, "late"),
    }
    before = dump(s.db)
    with pytest.raises(StaleError) as info:
        calls[op]()
    assert (info.value.reason, info.value.task_id) == (reason, reply_id)
    assert dump(s.db) == before


def test_outbox_mark_sent_marks_fences_each_row_of_a_batch_on_its_own(
    s: Stores, clock: FakeClock
) -> None:
    """One batch, rows of two fences, a second mark of one reply and a stale one: each
    row is marked or refused as if it were alone, in the order given."""
    for mid in ("m1", "m2", "m3"):
        finished(s, mid)
    one, stale, again = s.outbox.claim("d1", 3)
    s.outbox.retry(again.reply_id, "d1", again.fence, "boom")
    clock.advance(OUTBOX_BACKOFF.cap_s)
    (again,) = s.outbox.claim("d1", 1)
    assert again.fence == 2
    results = s.outbox.mark_sent_marks(
        "d1",
        [
            (one.reply_id, one.fence, "1-0", clock.now()),
            (again.reply_id, again.fence, "2-0", clock.now()),
            (one.reply_id, one.fence, "3-0", clock.now()),
            (stale.reply_id, stale.fence + 1, "4-0", clock.now()),
        ],
    )
    assert results[:2] == [None, None]
    assert isinstance(results[2], StaleError)
    assert results[2].reason == "not_sending"
    assert isinstance(results[3], FencedError)
    assert (row(s, one.reply_id).state, row(s, one.reply_id).entry_id) == ("sent", "1-0")
    assert (row(s, again.reply_id).state, row(s, again.reply_id).entry_id) == ("sent", "2-0")
    assert (row(s, stale.reply_id).state, row(s, stale.reply_id).entry_id) == ("sending", None)


def test_outbox_fenced_write_raises_unknown_reply_when_no_such_row(s: Stores) -> None:
    with pytest.raises(UnknownReply):
        s.outbox.mark_sent("nope", "d1", 1, "1-0")
    with pytest.raises(UnknownReply):
        s.outbox.replay("nope", "ops")


def test_outbox_retry_backs_off_then_goes_dead_after_budget(s: Stores, clock: FakeClock) -> None:
    reply_id = finished(s)
    for attempt in range(1, OUTBOX_MAX_ATTEMPTS + 1):
        (r,) = s.outbox.claim("d1", 1)
        assert (r.attempts, r.fence) == (attempt, attempt)
        now = clock.now()
        new_state = s.outbox.retry(reply_id, "d1", r.fence, f"error {attempt}")
        if attempt < OUTBOX_MAX_ATTEMPTS:
            assert new_state == "pending"
            delay = not_before(s, reply_id) - now
            ceiling = OUTBOX_BACKOFF.ceiling(attempt)
            assert ceiling / 2 <= delay <= ceiling
            assert s.outbox.claim("d1", 1) == []  # waiting out the backoff
            clock.set(not_before(s, reply_id))
    assert new_state == "dead"
    dead = row(s, reply_id)
    assert (dead.state, dead.attempts, dead.owner) == ("dead", OUTBOX_MAX_ATTEMPTS, None)
    assert dead.last_error == f"error {OUTBOX_MAX_ATTEMPTS}"  # the last error is kept
    clock.advance(3600)
    assert s.outbox.claim("d1", 1) == []  # dead rows are never picked up on their own
    assert s.outbox.counts() == {"pending": 0, "sending": 0, "sent": 0, "dead": 1}


def test_outbox_mark_dead_is_immediate_and_keeps_error(s: Stores, clock: FakeClock) -> None:
    reply_id, fence = held(s, clock)
    s.outbox.mark_dead(reply_id, "d1", fence, "content conflict in redis")
    dead = row(s, reply_id)
    assert (dead.state, dead.attempts, dead.last_error) == ("dead", 1, "content conflict in redis")
    assert [r.reply_id for r in s.outbox.list("dead")] == [reply_id]


def test_outbox_replay_records_who_and_when_and_keeps_identity(s: Stores, clock: FakeClock) -> None:
    reply_id, fence = held(s, clock)
    original = row(s, reply_id)
    s.outbox.mark_dead(reply_id, "d1", fence, "gave up")
    clock.advance(100)
    replayed = s.outbox.replay(reply_id, "ops-carol")
    assert (replayed.state, replayed.attempts, replayed.replays) == ("pending", 0, 1)
    assert (replayed.replayed_by, replayed.replayed_at) == ("ops-carol", T0 + 100)
    assert replayed.last_error == "gave up"
    assert row(s, reply_id) == replayed
    (again,) = s.outbox.claim("d2", 1)
    assert (again.reply_id, again.body, again.content_hash) == (
        reply_id,
        original.body,
        original.content_hash,
    )
    assert again.fence == fence + 1  # the fence never goes back
    s.outbox.mark_dead(reply_id, "d2", again.fence, "still failing")
    clock.advance(5)
    assert s.outbox.replay(reply_id, "ops-dave").replays == 2
    assert (row(s, reply_id).replayed_by, row(s, reply_id).replayed_at) == ("ops-dave", T0 + 105)


@pytest.mark.parametrize("current", ["pending", "sending", "sent"])
def test_outbox_replay_is_refused_when_not_dead(s: Stores, clock: FakeClock, current: str) -> None:
    reply_id = finished(s)
    if current != "pending":
        (r,) = s.outbox.claim("d1", 1)
        if current == "sent":
            s.outbox.mark_sent(reply_id, "d1", r.fence, "1-0")
    before = dump(s.db)
    with pytest.raises(StaleError) as info:
        s.outbox.replay(reply_id, "ops")
    assert info.value.reason == "not_dead"
    assert dump(s.db) == before


def test_outbox_requeue_sent_puts_back_rows_sent_since(s: Stores, clock: FakeClock) -> None:
    ids = []
    for n in range(3):
        reply_id = finished(s, f"m{n}")
        (r,) = s.outbox.claim("d1", 1)
        s.outbox.mark_sent(reply_id, "d1", r.fence, f"{n}-0")
        ids.append(reply_id)
        clock.advance(10)
    unsent = finished(s, "m-unsent")
    assert s.outbox.requeue_sent(since=T0 + 10) == 2
    assert [row(s, i).state for i in ids] == ["sent", "pending", "pending"]
    assert row(s, unsent).state == "pending"
    assert row(s, ids[1]).attempts == 0
    assert s.outbox.requeue_sent() == 1
    assert s.outbox.counts()["sent"] == 0


def test_outbox_oldest_unsent_age_follows_clock(s: Stores, clock: FakeClock) -> None:
    def oldest_unsent_age() -> float | None:
        age: float | None = snapshot(s.db, clock.now())["delivery"]["oldest_unsent_age_s"]
        return age

    assert oldest_unsent_age() is None
    reply_id = finished(s)
    clock.advance(7)
    assert oldest_unsent_age() == 7
    (r,) = s.outbox.claim("d1", 1)
    s.outbox.mark_sent(reply_id, "d1", r.fence, "1-0")
    assert oldest_unsent_age() is None


def test_outbox_reply_body_is_fixed_at_enqueue(s: Stores, clock: FakeClock) -> None:
    reply_id = finished(s)
    body = json.loads(row(s, reply_id).body)
    assert (body["reply_id"], body["status"], body["result"]) == (reply_id, "done", {"mid": "m1"})
    (r,) = s.outbox.claim("d1", 1)
    s.outbox.retry(reply_id, "d1", r.fence, "x")
    clock.advance(60)
    (r2,) = s.outbox.claim("d1", 1)
    assert r2.body == r.body
    assert r2.content_hash == r.content_hash


def test_outbox_claim_marks_dead_a_row_whose_publishers_keep_dying(
    store_target: str, clock: FakeClock
) -> None:
    from broker_adapter.protocol.envelope import Envelope
    from broker_adapter.store import AcceptItem
    from broker_adapter.store.outbox_types import OutboxPolicy

    db = open_any(store_target)
    tasks = stores(db, clock).tasks
    outbox = OutboxStore(db, clock, OutboxPolicy(lease_s=5, max_attempts=2))
    env = Envelope.build(message_id="m", sender="a", payload={}, deadline=clock.now() + 1)
    tasks.accept([AcceptItem("a", env)])
    clock.advance(2)
    tasks.reconcile()  # expired: its reply is in the outbox
    for _ in range(2):  # each publisher claims the row and dies holding it
        (row,) = outbox.claim("doomed", 10)
        clock.advance(6)
    assert outbox.claim("next", 10) == []
    (dead,) = outbox.list(state="dead")
    assert dead.reply_id == row.reply_id
    assert dead.attempts == 2
    assert dead.last_error == "publisher lease expired on the last attempt"
