"""Receiver receipts: each reply applied once, receipt and effect in one transaction."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.protocol.canonical import canonical_json, sha256_hex
from broker_adapter.protocol.reply import Reply
from broker_adapter.store import ReceiptOutcome
from tests.support.store_script import (
    T0,
    Stores,
    apply_receipt,
    create_effects_table,
    dump,
    open_any,
    record_effect,
    stores,
)


@pytest.fixture
def s(store_target: str, clock: FakeClock) -> Iterator[Stores]:
    """The stores on a database with the test effect's table."""
    with open_any(store_target) as db:
        create_effects_table(db)
        yield stores(db, clock)


def reply(status: str = "done", **extra: Any) -> tuple[bytes, str]:
    body = canonical_json(
        {"v": 1, "reply_id": "r-t1", "task_id": "t1", "message_id": "m1", "status": status} | extra
    )
    return body, sha256_hex(body)


class CountingEffect:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, conn: Any, value: Reply) -> Any:
        self.calls += 1
        return record_effect(conn, value)


def test_receipt_apply_runs_effect_once_and_stores_receipt(s: Stores, clock: FakeClock) -> None:
    body, digest = reply()
    effect = CountingEffect()
    outcome, receipt = apply_receipt(
        s.receipts,
        reply_id="r-t1",
        content_hash=digest,
        principal="alice",
        body=body,
        effect=effect,
        entry_id="5-0",
    )
    assert outcome is ReceiptOutcome.APPLIED
    assert effect.calls == 1
    assert (receipt.reply_id, receipt.content_hash, receipt.principal) == ("r-t1", digest, "alice")
    assert (receipt.message_id, receipt.task_id, receipt.status) == ("m1", "t1", "done")
    assert (receipt.entry_id, receipt.received_at, receipt.effects) == ("5-0", T0, 1)
    assert receipt.effect_result == '{"applied":"r-t1"}'
    assert receipt.reply()["status"] == "done"
    assert s.receipts.get("r-t1") == receipt
    assert dump(s.db)["effects"] == [{"reply_id": "r-t1", "status": "done"}]


def test_receipt_apply_returns_earlier_receipt_when_duplicate(s: Stores, clock: FakeClock) -> None:
    body, digest = reply()
    effect = CountingEffect()
    _, first = apply_receipt(
        s.receipts,
        reply_id="r-t1",
        content_hash=digest,
        principal="alice",
        body=body,
        effect=effect,
    )
    before = dump(s.db)
    clock.advance(30)
    outcome, again = apply_receipt(
        s.receipts,
        reply_id="r-t1",
        content_hash=digest,
        principal="alice",
        body=body,
        effect=effect,
        entry_id="6-0",
    )
    assert outcome is ReceiptOutcome.DUPLICATE
    assert again == first
    assert effect.calls == 1
    assert dump(s.db) == before


def test_receipt_apply_refuses_different_content_for_same_reply_id(s: Stores) -> None:
    body, digest = reply()
    effect = CountingEffect()
    _, first = apply_receipt(
        s.receipts,
        reply_id="r-t1",
        content_hash=digest,
        principal="alice",
        body=body,
        effect=effect,
    )
    before = dump(s.db)
    other_body, other_digest = reply(status="failed")
    outcome, stored = apply_receipt(
        s.receipts,
        reply_id="r-t1",
        content_hash=other_digest,
        principal="alice",
        body=other_body,
        effect=effect,
    )
    assert outcome is ReceiptOutcome.CONFLICT
    assert stored == first
    assert stored.content_hash == digest
    assert effect.calls == 1
    assert dump(s.db) == before


def test_receipt_apply_rolls_back_effect_and_receipt_when_effect_raises(s: Stores) -> None:
    body, digest = reply()

    def half_done(conn: Any, value: Reply) -> Any:
        record_effect(conn, value)  # a write that must not survive
        raise RuntimeError("downstream refused")

    before = dump(s.db)
    with pytest.raises(RuntimeError, match="downstream refused"):
        apply_receipt(
            s.receipts,
            reply_id="r-t1",
            content_hash=digest,
            principal="alice",
            body=body,
            effect=half_done,
        )
    assert dump(s.db) == before
    assert s.receipts.get("r-t1") is None
    # The redelivery then applies cleanly, exactly once.
    outcome, _ = apply_receipt(
        s.receipts,
        reply_id="r-t1",
        content_hash=digest,
        principal="alice",
        body=body,
        effect=record_effect,
    )
    assert outcome is ReceiptOutcome.APPLIED
    assert len(dump(s.db)["effects"]) == 1


def test_receipt_apply_rolls_back_when_effect_result_is_not_json(s: Stores) -> None:
    body, digest = reply()

    def returns_set(conn: Any, value: Reply) -> Any:
        record_effect(conn, value)
        return {1, 2}

    with pytest.raises(ValueError):  # noqa: PT011 - canonical_json's contract
        apply_receipt(
            s.receipts,
            reply_id="r-t1",
            content_hash=digest,
            principal="alice",
            body=body,
            effect=returns_set,
        )
    assert dump(s.db)["effects"] == []
    assert dump(s.db)["receipts"] == []


def test_receipt_apply_records_no_effect_when_effect_is_none(s: Stores) -> None:
    body, digest = reply()
    outcome, receipt = apply_receipt(
        s.receipts, reply_id="r-t1", content_hash=digest, principal="alice", body=body, effect=None
    )
    assert outcome is ReceiptOutcome.APPLIED
    assert (receipt.effects, receipt.effect_result) == (0, None)
    assert dump(s.db)["effects"] == []


def test_receipt_list_returns_receipts_in_arrival_order(s: Stores, clock: FakeClock) -> None:
    for n in range(3):
        body = canonical_json({"reply_id": f"r-{n}", "status": "done"})
        apply_receipt(
            s.receipts,
            reply_id=f"r-{n}",
            content_hash=sha256_hex(body),
            principal="alice",
            body=body,
            effect=None,
        )
        clock.advance(1)
    assert [r.reply_id for r in s.receipts.list()] == ["r-0", "r-1", "r-2"]
    assert [r.received_at for r in s.receipts.list()] == [T0, T0 + 1, T0 + 2]
