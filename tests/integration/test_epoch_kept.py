"""The Redis epoch is kept in the database too: a deleted epoch key alone is not a wipe
(nothing is re-sent, the key is set back), and an epoch that changed while the dispatcher
was down is seen at its start."""

from __future__ import annotations

from typing import Any

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.protocol.keys import Keys
from broker_adapter.stages.dispatch.loss import LossEvent
from broker_adapter.store.db import Database
from tests.support.backends import real_backend
from tests.support.redis_server import RedisServer
from tests.support.replies_script import entries_per_reply, make_dispatcher, make_replies

pytestmark = pytest.mark.integration

P = "alice"


def test_deleting_the_epoch_key_alone_resends_nothing_and_restores_the_key(
    redis_server: RedisServer, db: Database, clock: FakeClock, prefix: str
) -> None:
    keys = Keys(prefix)
    client: Any = redis_server.client()
    ids = make_replies(db, clock, P, 3)
    d = make_dispatcher(real_backend(redis_server), db, clock, prefix)
    first = d.watch()
    assert d.step() == 3
    clock.advance(1)
    assert d.watch().event is LossEvent.NONE  # a look after the sends
    assert d.outbox.redis_epoch() == first.epoch  # kept in the database
    for _ in range(3):  # at every deletion
        client.delete(keys.epoch())
        clock.advance(1)
        watch = d.watch()
        assert (watch.event, watch.requeued) == (LossEvent.NONE, 0)
        assert client.get(keys.epoch()) == first.epoch.encode()
    assert d.stats.epoch_restored == 3
    assert d.outbox.counts()["sent"] == 3
    assert entries_per_reply(client, keys.replies(P)) == dict.fromkeys(ids, 1)
    # the other side: the key AND the records gone (a wipe of this prefix) is a wipe
    client.delete(keys.epoch(), *[keys.reply_record(P, r) for r in ids])
    clock.advance(1)
    assert (d.watch().event, d.outbox.counts()["pending"]) == (LossEvent.WIPE, 3)
    client.close()


def test_an_epoch_changed_while_the_dispatcher_was_down_is_a_wipe_at_its_start(
    redis_server: RedisServer, db: Database, clock: FakeClock, prefix: str
) -> None:
    keys = Keys(prefix)
    client: Any = redis_server.client()
    make_replies(db, clock, P, 2)
    d = make_dispatcher(real_backend(redis_server), db, clock, prefix)
    d.watch()
    assert d.step() == 2
    client.set(keys.epoch(), "another-dispatcher-set-this-after-a-wipe")
    late = make_dispatcher(real_backend(redis_server), db, clock, prefix, owner="d2")
    watch = late.watch()
    assert (watch.event, watch.requeued) == (LossEvent.WIPE, 2)
    # and a start with the kept epoch unchanged is not one
    again = make_dispatcher(real_backend(redis_server), db, clock, prefix, owner="d3")
    assert again.watch().event is LossEvent.NONE
    client.close()
