"""The envelope's optional ``traceparent``: validated strictly, left out when absent, not
part of the fingerprint, kept with the task and carried into every reply of the request."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest

from broker_adapter.client.publisher import Publisher
from broker_adapter.clock import FakeClock
from broker_adapter.errors import EnvelopeError
from broker_adapter.protocol.envelope import Envelope, check_traceparent
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.signing import Keyring
from broker_adapter.stages.shared import tracing
from broker_adapter.store import Outcome
from broker_adapter.store.settle import Settlement
from tests.support.ingest_script import KEYRING
from tests.support.store_script import (
    LEASE_S,
    MAX_HOPS,
    T0,
    Stores,
    envelope,
    item,
    open_any,
    stores,
)

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
OTHER = "00-4bf92f3577b34da6a3ce929d0e0e4736-b7ad6b7169203331-00"


# -- the envelope member ----------------------------------------------------------------------


@pytest.mark.parametrize("value", [TP, OTHER, "00-" + "f" * 32 + "-" + "f" * 16 + "-ff"])
def test_a_w3c_traceparent_is_kept_and_written(value: str) -> None:
    env = envelope("m-1", traceparent=value)
    assert env.traceparent == value
    assert json.loads(env.to_json())["traceparent"] == value
    assert Envelope.from_json(env.to_json()) == env


def test_traceparent_is_absent_by_default_and_left_out_of_the_wire_form() -> None:
    env = envelope("m-1")
    assert env.traceparent is None
    assert b"traceparent" not in env.to_json()
    assert Envelope.from_json(env.to_json()) == env
    assert envelope("m-1", traceparent=None).to_json() == env.to_json()


@pytest.mark.parametrize(
    "value",
    [
        TP.upper(),  # uppercase hex
        "01" + TP[2:],  # another version
        "ff" + TP[2:],  # the forbidden version
        TP + "-00",  # version 00 has exactly four parts
        TP + "\n",
        " " + TP,
        TP[:-1],  # flags of one digit
        TP.replace("4bf92f3577b34da6a3ce929d0e0e4736", "0" * 32),  # invalid trace id
        TP.replace("00f067aa0ba902b7", "0" * 16),  # invalid parent id
        TP.replace("-", "_"),
        TP.replace("4bf9", "4bg9"),
        "",
    ],
)
def test_a_malformed_traceparent_is_refused(value: str) -> None:
    with pytest.raises(EnvelopeError) as info:
        envelope("m-1", traceparent=value)
    assert (info.value.field, info.value.reason) == ("traceparent", "bad_value")
    with pytest.raises(EnvelopeError):
        Envelope.from_json(
            envelope("m-1").to_json()[:-1] + b',"traceparent":"' + value.encode() + b'"}'
        )


@pytest.mark.parametrize("value", [1, ["x"], {"a": 1}, True])
def test_a_traceparent_that_is_no_string_is_refused(value: Any) -> None:
    with pytest.raises(EnvelopeError) as info:
        check_traceparent(value)
    assert (info.value.field, info.value.reason) == ("traceparent", "bad_type")


def test_traceparent_is_not_part_of_the_fingerprint() -> None:
    """A resend from another span (W3C changes the parent id at every hop) is the same
    request, as a resend with a recomputed deadline is."""
    plain, traced, other = (
        envelope("m-1", **tp) for tp in ({}, {"traceparent": TP}, {"traceparent": OTHER})
    )
    assert plain.fingerprint() == traced.fingerprint() == other.fingerprint()
    assert "traceparent" not in traced.content()
    assert traced != plain  # still a member of the envelope


def test_traceparent_is_checked_after_the_other_members() -> None:
    with pytest.raises(EnvelopeError) as info:
        Envelope.build(message_id="m-1", sender="alice", payload={}, deadline=-1, traceparent="bad")
    assert info.value.field == "deadline"


# -- kept with the task, carried into the reply -----------------------------------------------


@pytest.fixture
def s(store_target: str, clock: FakeClock) -> Iterator[Stores]:
    """The stores on SQLite and on PostgreSQL: the traceparent's path is each backend's."""
    with open_any(store_target) as db:
        yield stores(db, clock)


def _bodies(s: Stores) -> dict[str, dict[str, Any]]:
    return {r.reply_id: json.loads(r.body) for r in s.outbox.list()}


def test_claims_carry_the_traceparent(s: Stores) -> None:
    s.tasks.accept([item("m-1", traceparent=TP), item("m-2")])
    assert {c.message_id: c.traceparent for c in s.tasks.claim("w1", 2)} == {
        "m-1": TP,
        "m-2": None,
    }
    intake = s.tasks.accept_and_claim([item("m-3", traceparent=OTHER)], [("w2", 1)])
    [handed] = s.tasks.handed("w2", intake.claimed[0])
    assert handed.traceparent == OTHER


def test_every_terminal_reply_carries_the_requests_traceparent(s: Stores, clock: FakeClock) -> None:
    """done (``finish`` and the pre-encoded ``settle_many``), failed, cancelled, expired
    (at accept and by the clock), hop_limit, the lease lost on the last attempt."""
    ids = {
        r.task_id: mid
        for r, mid in zip(
            s.tasks.accept(
                [
                    item("done", traceparent=TP),
                    item("settled", traceparent=TP),
                    item("failed", traceparent=TP),
                    item("cancelled", traceparent=TP),
                    item("late", traceparent=TP, deadline=T0 + 5),
                    item("lost", traceparent=TP, max_attempts=1),
                    item("past", traceparent=TP, deadline=T0 - 1),
                    item("hops", traceparent=TP, hops=MAX_HOPS + 1),
                ]
            ),
            ["done", "settled", "failed", "cancelled", "late", "lost", "past", "hops"],
            strict=True,
        )
    }
    by_mid = {mid: tid for tid, mid in ids.items()}
    s.tasks.cancel(str(by_mid["cancelled"]))
    claims = {c.message_id: c for c in s.tasks.claim("w1", 10)}
    assert set(claims) == {"done", "settled", "failed", "late", "lost"}
    s.tasks.finish(claims["done"].task_id, "w1", claims["done"].fence, {"ok": 1})
    c = claims["settled"]
    s.tasks.settle_batch(
        [Settlement(c.task_id, "w1", c.fence, result='{"ok":2}', claimed=c)], "", 0
    )
    s.tasks.fail(claims["failed"].task_id, "w1", claims["failed"].fence, "no", retryable=False)
    clock.advance(LEASE_S + 1)  # "late" passes its deadline, "lost" its lease
    s.tasks.reconcile()
    bodies = _bodies(s)
    statuses = {b["message_id"]: b["status"] for b in bodies.values()}
    assert statuses == {
        "done": "done",
        "settled": "done",
        "failed": "failed",
        "cancelled": "cancelled",
        "late": "expired",
        "lost": "failed",
        "past": "expired",
        "hops": "hop_limit",
    }
    assert {b["message_id"]: b["traceparent"] for b in bodies.values()} == dict.fromkeys(
        statuses, TP
    )


def test_a_request_without_traceparent_gets_the_reply_it_always_got(s: Stores) -> None:
    s.tasks.accept([item("m-1")])
    [c] = s.tasks.claim("w1", 1)
    s.tasks.finish(c.task_id, "w1", c.fence, {"ok": 1})
    [body] = _bodies(s).values()
    assert sorted(body) == sorted(
        [
            "v",
            "reply_id",
            "task_id",
            "principal",
            "message_id",
            "correlation_id",
            "status",
            "result",
            "error",
            "attempts",
            "fence",
            "finished_at",
        ]
    )


def test_a_resend_in_another_trace_is_a_duplicate_and_a_conflict_answer_carries_its_own(
    s: Stores,
) -> None:
    [first] = s.tasks.accept([item("m-1", traceparent=TP)])
    [again] = s.tasks.accept([item("m-1", traceparent=OTHER)])
    assert (again.outcome, again.task_id) == (Outcome.DUPLICATE, first.task_id)
    [clash] = s.tasks.accept([item("m-1", traceparent=OTHER, payload={"q": "other"})])
    assert clash.outcome is Outcome.CONFLICT
    answer = _bodies(s)[str(clash.reply_id)]
    assert (answer["status"], answer["traceparent"]) == ("conflict", OTHER)
    [c] = s.tasks.claim("w1", 1)
    assert c.traceparent == TP  # the stored request's


# -- the publisher ----------------------------------------------------------------------------


def _published(client: Any, keys: Keys) -> list[dict[str, Any]]:
    """The envelopes of the items in the submit list (names and values in turn)."""
    items = [json.loads(i) for i in client.lrange(keys.submit(), 0, -1)]
    return [json.loads(dict(zip(i[::2], i[1::2], strict=True))["env"]) for i in items]


def test_publisher_sends_the_traceparent_it_is_given() -> None:
    client = fakeredis.FakeRedis()
    keys = Keys("tp")
    publisher = Publisher(client, keys, "alice", Keyring(KEYRING))
    env = envelope("m-1")
    publisher.publish(env)
    publisher.publish(env, traceparent=TP)
    publisher.publish(envelope("m-2", traceparent=OTHER))
    publisher.publish(envelope("m-3", traceparent=OTHER), traceparent=TP)
    sent = _published(client, keys)
    assert [e.get("traceparent") for e in sent] == [None, TP, OTHER, TP]
    with pytest.raises(EnvelopeError):
        publisher.publish(env, traceparent="00-nope")
    assert len(_published(client, keys)) == 4


# -- the tracing module without a tracer ------------------------------------------------------


def test_tracing_without_opentelemetry_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_api", None)  # as if the package were not installed
    assert tracing.tracer() is None
    assert tracing.current_traceparent() is None
    with tracing.handler_span(object()) as span:
        span.ended(object())
    tracing.ingested([object()], [object()], tracing.now())  # type: ignore[list-item]
    tracing.published([object()], [object()], tracing.now())  # type: ignore[list-item]
    tracing.received([object()], [object()], tracing.now())  # type: ignore[list-item]


def test_format_traceparent_is_what_the_envelope_accepts() -> None:
    text = tracing.format_traceparent(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0xF067AA0BA902B7, 1)
    assert text == TP
    assert check_traceparent(text) == TP


def test_a_span_that_cannot_be_recorded_never_stops_a_stage(
    s: Stores, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    trace = pytest.importorskip("opentelemetry.trace")

    class Broken:
        def get_tracer(self, name: str) -> Broken:
            return self

        def start_span(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("exporter gone")

    monkeypatch.setattr(trace, "get_tracer_provider", Broken)
    [accepted] = s.tasks.accept([item("m-1", traceparent=TP)])
    with caplog.at_level("WARNING", logger="broker_adapter.stages.tracing"):
        tracing.ingested([item("m-1", traceparent=TP)], [accepted], tracing.now())
    assert "ba.ingest span not recorded: RuntimeError('exporter gone')" in caplog.text
