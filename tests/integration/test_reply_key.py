"""A reply is signed with the key its request came with: a receiver that has not got a key
newly added to the adapter's keyring (a rotation under way) still verifies it."""

from __future__ import annotations

from typing import Any

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import Keys
from broker_adapter.store import AcceptItem, TaskStore
from broker_adapter.store.db import Database
from tests.support.redis_server import RedisServer
from tests.support.replies_script import REPLY_KEYS, dispatcher_for

pytestmark = pytest.mark.integration

P = "alice"
NEWEST, OLDER = list(REPLY_KEYS[P])  # the adapter's first key, and the one before it


def _kids(
    redis_server: RedisServer,
    db: Database,
    clock: FakeClock,
    prefix: str,
    request_kids: list[str | None],
) -> list[str]:
    """Accept one request per entry of ``request_kids`` (the key it verified with), finish
    each, publish the replies; the ``kid`` of each reply entry, in order."""
    tasks = TaskStore(db, clock)
    items = [
        AcceptItem(
            P,
            Envelope.build(
                message_id=f"m{i}", sender=P, payload={"i": i}, deadline=clock.now() + 3600
            ),
            None,
            kid,
        )
        for i, kid in enumerate(request_kids)
    ]
    order = [r.task_id for r in tasks.accept(items)]
    for t in tasks.claim("worker", len(items)):
        tasks.finish(t.task_id, "worker", t.fence, {"ok": True})
    assert dispatcher_for(redis_server.url, db, clock, prefix, "d1").step() == len(items)
    client: Any = redis_server.client()
    by_reply = {
        f[b"reply_id"].decode(): f[b"kid"].decode()
        for _, f in client.xrange(Keys(prefix).replies(P))
    }
    client.close()
    return [by_reply[f"r-{task_id}"] for task_id in order]


def test_reply_is_signed_with_the_key_its_request_came_with(
    redis_server: RedisServer, db: Database, clock: FakeClock, prefix: str
) -> None:
    kids = _kids(redis_server, db, clock, prefix, [OLDER, NEWEST, None, "alice-r0"])
    # the older key, the newest; no key (ACL mode) and a key rotated out: the first key
    assert kids == [OLDER, NEWEST, NEWEST, NEWEST]
