"""Replies have an age: a receiver refuses a reply older than its window (``stale``), and
the adapter never sends a reply again once it is older than its own window. The clock is
injected (``FakeClock``); the streams are a real redis-server's."""

from __future__ import annotations

from typing import Any

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.errors import ConfigError, StaleError
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.reply import Reply, conflict_body, encode_body, load_body
from broker_adapter.stages.receiver.receiver import ReceiverConfig
from broker_adapter.store import OutboxStore, ReceiptStore
from broker_adapter.store.db import Database
from broker_adapter.store.outbox_types import OutboxPolicy
from tests.support.redis_server import RedisServer
from tests.support.replies_script import (
    dispatcher_for,
    drain,
    effect_counts,
    make_replies,
    receiver_for,
)

pytestmark = pytest.mark.integration

P = "alice"
RETENTION_S = 1000.0
MAX_AGE_S = 500.0


def _dead_reasons(client: Any, stream: str) -> list[bytes]:
    return [f[b"dl.reason"] for _, f in client.xrange(stream)]


def test_receiver_refuses_a_replayed_reply_older_than_its_window_and_applies_nothing_twice(
    redis_server: RedisServer,
    agent_db: Database,
    rx_db: Database,
    rx_path: Any,
    clock: FakeClock,
    prefix: str,
) -> None:
    client: Any = redis_server.client()
    keys = Keys(prefix)
    (reply_id,) = make_replies(agent_db, clock, P, 1)
    assert dispatcher_for(redis_server.url, agent_db, clock, prefix, "d1").step() == 1
    (_, captured), *_ = client.xrange(keys.replies(P))  # what an attacker copies
    rc = receiver_for(
        redis_server.url,
        rx_db,
        clock,
        prefix,
        P,
        "r1",
        retention_s=RETENTION_S,
        max_reply_age_s=MAX_AGE_S,
    )
    assert drain(rc) == 1
    assert effect_counts(rx_path) == {reply_id: 1}

    # At the window's edge the replay is still let in: its receipt makes it a duplicate.
    clock.advance(MAX_AGE_S)
    client.xadd(keys.replies(P), captured)
    assert drain(rc) == 1
    assert rc.stats.duplicates == 1
    assert _dead_reasons(client, keys.replies_dead(P)) == []

    # Past it, and past the receipt's lifetime: refused as stale, the effect not run again.
    clock.advance(RETENTION_S)
    ReceiptStore(rx_db, clock).purge(RETENTION_S)
    client.xadd(keys.replies(P), captured)
    assert drain(rc) == 0
    assert effect_counts(rx_path) == {reply_id: 1}
    assert _dead_reasons(client, keys.replies_dead(P)) == [b"stale"]
    assert rc.stats.bad == 1
    client.close()


def test_receiver_refuses_a_reply_just_past_its_window(
    redis_server: RedisServer,
    agent_db: Database,
    rx_db: Database,
    rx_path: Any,
    clock: FakeClock,
    prefix: str,
) -> None:
    client: Any = redis_server.client()
    keys = Keys(prefix)
    make_replies(agent_db, clock, P, 1)
    assert dispatcher_for(redis_server.url, agent_db, clock, prefix, "d1").step() == 1
    clock.advance(MAX_AGE_S + 0.001)  # published, not yet read: now too old
    rc = receiver_for(
        redis_server.url,
        rx_db,
        clock,
        prefix,
        P,
        "r1",
        retention_s=RETENTION_S,
        max_reply_age_s=MAX_AGE_S,
    )
    assert drain(rc) == 0
    assert effect_counts(rx_path) == {}
    assert _dead_reasons(client, keys.replies_dead(P)) == [b"stale"]
    client.close()


def test_receiver_window_must_be_below_its_retention_and_defaults_below_it() -> None:
    with pytest.raises(ConfigError):
        ReceiverConfig(principal=P, retention_s=RETENTION_S, max_reply_age_s=RETENTION_S)
    assert ReceiverConfig(principal=P, retention_s=RETENTION_S).reply_age_limit_s == 500.0
    default = ReceiverConfig(principal=P)
    assert default.reply_age_limit_s == default.retention_s - 3600.0
    assert OutboxPolicy().reply_window_s < default.reply_age_limit_s


def test_conflict_answer_carries_its_time() -> None:
    body = conflict_body("r-c", "t-1", P, "m1", None, "reused", "f1", "f0", answered_at=12.5)
    assert Reply.from_mapping(load_body(encode_body(body)[0])).made_at == 12.5


def test_adapter_never_puts_back_or_replays_a_reply_older_than_its_window(
    agent_db: Database, clock: FakeClock
) -> None:
    window = 100.0
    outbox = OutboxStore(agent_db, clock, OutboxPolicy(reply_window_s=window))
    (old,) = make_replies(agent_db, clock, P, 1, first=0)
    clock.advance(1.0)
    (edge,) = make_replies(agent_db, clock, P, 1, first=1)
    with agent_db.write("test") as c:  # both published (as the dispatcher marks them)
        c.execute("UPDATE outbox SET state = 'sent', sent_at = ?, entry_id = '1-0'", (clock.now(),))
    clock.advance(window)  # ``edge`` is exactly ``window`` old, ``old`` one second more
    assert outbox.requeue_sent(None) == 1  # a wipe: only the one inside the window
    assert outbox.get(edge).state == "pending"  # type: ignore[union-attr]
    assert outbox.get(old).state == "sent"  # type: ignore[union-attr]
    with agent_db.write("test") as c:
        c.execute("UPDATE outbox SET state = 'dead' WHERE reply_id = ?", (old,))
    with pytest.raises(StaleError) as refused:
        outbox.replay(old, "operator")
    assert refused.value.reason == "stale"
