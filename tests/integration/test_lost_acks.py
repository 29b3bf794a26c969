"""An outbox whose every publication succeeded at Redis but whose acknowledgement was lost,
attempt after attempt, until the retry budget was spent (a TCP proxy forwards each
publication and drops Redis's answer: the script ran, the dispatcher never learns it).

The rows end ``dead`` (no trusted confirmation, not "not delivered"); Redis holds each
reply once (the publication record makes every retry a no-op), the receiver applies each
once, and the operator's replay finds them in Redis and marks them sent without sending
anything again: no reply lost, none doubled. A real redis-server, the real dispatcher,
receiver and stores."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker_adapter.backoff import Backoff
from broker_adapter.clock import FakeClock
from broker_adapter.errors import RedisUnavailable
from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import connect
from broker_adapter.stages.dispatch.dispatcher import Dispatcher, DispatcherConfig
from broker_adapter.stages.dispatch.replay import ReplayOutcome
from broker_adapter.stages.shared.publish import PUBLISH_SCRIPT
from broker_adapter.store import Database, OutboxStore
from broker_adapter.store.outbox_types import OutboxPolicy
from tests.chaos.proxy import ChaosProxy
from tests.support.redis_server import RedisServer
from tests.support.replies_script import (
    drain,
    effect_counts,
    entries_per_reply,
    make_replies,
    receiver_for,
    reply_keyring,
)

pytestmark = pytest.mark.integration

PRINCIPAL = "alice"
ATTEMPTS = 3
N = 3


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[ChaosProxy]:
    chaos = ChaosProxy(redis_server.port)
    chaos.start()
    yield chaos
    chaos.stop()


def test_acks_lost_until_the_budget_is_spent_lose_no_reply_and_double_none(
    redis_server: RedisServer,
    proxy: ChaosProxy,
    agent_db: Database,
    rx_db: Database,
    rx_path: Path,
    clock: FakeClock,
    prefix: str,
) -> None:
    reply_ids = make_replies(agent_db, clock, PRINCIPAL, N)
    direct: redis.Redis = redis_server.client()
    direct.script_load(PUBLISH_SCRIPT)  # so the first EVALSHA runs (no NOSCRIPT round)
    policy = OutboxPolicy(max_attempts=ATTEMPTS, backoff=Backoff(base_s=0.0, cap_s=0.0))
    dispatcher = Dispatcher(
        DispatcherConfig(prefix=prefix, owner="d1"),
        connect(proxy.url),
        OutboxStore(agent_db, clock, policy),
        keyring=reply_keyring(),
        clock=clock,
    )
    stream = Keys(prefix).replies(PRINCIPAL)
    for attempt in range(ATTEMPTS):
        proxy.drop_reply_once(b"EVALSHA")  # the publications run; their answer is lost
        with pytest.raises(RedisUnavailable):
            dispatcher.step()
        # every reply reached Redis at the first attempt, and only then
        assert entries_per_reply(direct, stream) == dict.fromkeys(reply_ids, 1), attempt
    outbox = OutboxStore(agent_db, clock)
    dead = outbox.list(state="dead", limit=100)
    assert sorted(r.reply_id for r in dead) == sorted(reply_ids)  # the budget is spent
    assert all(r.attempts == ATTEMPTS for r in dead)
    assert dispatcher.stats.failed == N * ATTEMPTS
    assert dispatcher.stats.published == 0  # never confirmed
    # the receiver applies each reply once
    receiver = receiver_for(redis_server.url, rx_db, clock, prefix, PRINCIPAL, "r1")
    drain(receiver)
    assert effect_counts(rx_path) == dict.fromkeys(reply_ids, 1)
    # the operator's replay checks Redis first: found, marked sent, nothing sent again
    for reply_id in reply_ids:
        result = dispatcher.replay(reply_id, "alice")
        assert result.outcome is ReplayOutcome.ALREADY_PUBLISHED, result
    assert outbox.list(state="dead", limit=100) == []
    assert dispatcher.step() == 0  # nothing left to publish
    assert entries_per_reply(direct, stream) == dict.fromkeys(reply_ids, 1)
    drain(receiver)
    assert effect_counts(rx_path) == dict.fromkeys(reply_ids, 1)
