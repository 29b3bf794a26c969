"""What a requester instance that never comes back costs in Redis, against a real
redis-server: no group, no stream, no key of its own; the replies to its requests (stream
entries and result records) stay at most the retention window, then the trim and the
purge take the reply stream's length and the key set back to where they were.

The trims take the earlier of the process clock and the server's, so the ``FakeClock``
starts a day behind the server; the stream entries are stamped by the server, so the
window is 1 ms (the result records go by the clock, on both sides of their edge)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from broker_adapter import AsyncClient
from broker_adapter.clock import FakeClock
from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import connect, text
from broker_adapter.stages.dispatch.dispatcher import Dispatcher, DispatcherConfig
from broker_adapter.store import OutboxStore
from broker_adapter.store.db import Database
from tests.support.cli import wait_for
from tests.support.redis_server import RedisServer
from tests.support.replies_script import make_replies, reply_keyring

pytestmark = pytest.mark.integration

P = "alice"
START = float(int(time.time()) - 86_400)
WINDOW_S = 0.001


def _keys(r: Any, prefix: str) -> set[str]:
    return {text(k) for k in r.keys(f"{prefix}:*")}


async def _instance_collects(url: str, prefix: str, message_ids: list[str]) -> list[Any]:
    """An instance that looks its replies up, then goes away (it tells Redis nothing: its
    connections just close)."""
    async with AsyncClient(url, P, reply_keyring(), prefix=prefix, instance="gone") as client:
        return [await client.result(mid) for mid in message_ids]


def test_an_instance_that_never_returns_leaves_nothing_past_the_retention_window(
    redis_server: RedisServer, db: Database, prefix: str
) -> None:
    clock = FakeClock(START)
    keys = Keys(prefix)
    r: Any = connect(redis_server.url)
    stream = keys.replies(P)
    r.xadd(stream, {"x": "1"})
    r.xtrim(stream, maxlen=0)  # the stream exists, empty: a principal that was used before
    d = Dispatcher(
        DispatcherConfig(prefix=prefix, owner="d1", retention_s=WINDOW_S, trim_keep_s=0.0),
        r,
        OutboxStore(db, clock),
        keyring=reply_keyring(),
        clock=clock,
    )
    d.watch()  # the adapter's own marker (the epoch key) is there before and after
    before_keys, before_len = _keys(r, prefix), r.xlen(stream)
    make_replies(db, clock, P, 3)
    assert d.step() == 3
    found = asyncio.run(_instance_collects(redis_server.url, prefix, ["m0", "m1", "m2"]))
    assert [reply.status for reply in found] == ["done"] * 3
    assert r.xlen(stream) == before_len + 3
    assert r.xinfo_groups(stream) == []  # no group left behind to hold the trim point
    records = {keys.reply_result(P, f"m{i}") for i in range(3)} | {keys.reply_results(P)}
    assert records <= _keys(r, prefix)

    clock.advance(WINDOW_S / 2)  # inside the window: nothing goes
    d.trim()
    assert r.xlen(stream) == before_len + 3
    assert records <= _keys(r, prefix)

    clock.advance(86_400.0 + 3_600.0)  # past the window and the day the clock ran behind
    published_ms = int(text(r.xrange(stream)[-1][0]).partition("-")[0])
    wait_for(lambda: r.time()[0] * 1000 + r.time()[1] // 1000 > published_ms + 1, "1 ms")
    d.trim()
    assert d.stats.results_purged == 3
    assert r.xlen(stream) == before_len
    # the publication records' own TTL is the window (1 ms, on the server's clock)
    wait_for(lambda: _keys(r, prefix) == before_keys, "the keys as they were", timeout_s=10)
    assert _keys(r, prefix) == before_keys, _keys(r, prefix) ^ before_keys
