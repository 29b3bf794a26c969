"""The reply body format (protocol/reply.py): built and parsed by one module."""

from __future__ import annotations

import dataclasses

import pytest

from broker_adapter.protocol.canonical import canonical_json
from broker_adapter.protocol.reply import (
    BadReply,
    Reply,
    conflict_body,
    encode_body,
    load_body,
    reply_id_for,
    terminal_body,
)


def test_a_terminal_body_parses_back_into_the_reply_it_describes() -> None:
    body = terminal_body("t1", "done", "alice", "m1", "c1", '{"ok":true}', None, 2, 3, 1.5)
    data, content_hash = encode_body(body)
    reply = Reply.from_mapping(load_body(data))
    assert reply == Reply(
        reply_id=reply_id_for("t1"),
        status="done",
        task_id="t1",
        principal="alice",
        message_id="m1",
        correlation_id="c1",
        result={"ok": True},
        error=None,
        attempts=2,
        fence=3,
        finished_at=1.5,
        v=1,
    )
    assert reply.body == body
    assert reply.idempotency_key == "ba-reply:r-t1"
    assert len(content_hash) == 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        reply.status = "failed"  # type: ignore[misc]


def test_a_conflict_body_carries_both_fingerprints_and_no_fence() -> None:
    body = conflict_body("c-x", "t1", "alice", "m1", None, "reused", "f-new", "f-old")
    reply = Reply.from_mapping(load_body(canonical_json(body)))
    assert (reply.status, reply.task_id, reply.error) == ("conflict", "t1", "reused")
    assert (reply.fingerprint, reply.stored_fingerprint) == ("f-new", "f-old")
    assert reply.fence is None
    assert reply.attempts is None


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ({"status": "done"}, "no reply id"),
        ({"reply_id": 7}, "'reply_id' is not a string"),
        ({"reply_id": "r", "fence": "3"}, "'fence' is not an integer"),
        ({"reply_id": "r", "fence": True}, "'fence' is not an integer"),
        ({"reply_id": "r", "finished_at": "now"}, "'finished_at' is not a number"),
    ],
)
def test_a_body_with_a_field_of_the_wrong_type_is_a_bad_reply(
    body: dict[str, object], detail: str
) -> None:
    with pytest.raises(BadReply) as caught:
        Reply.from_mapping(load_body(canonical_json(body)))
    assert caught.value.reason == "bad_reply"
    assert detail in caught.value.detail
