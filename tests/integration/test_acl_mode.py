"""ACL mode on a real redis-server with real ACL users: the stream a principal may write is
what authenticates it, so no signature is needed, and a principal cannot write another's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import redis

from broker_adapter.auth import unsigned_fields
from broker_adapter.clock import FakeClock
from broker_adapter.errors import BrokerAdapterError
from broker_adapter.ingest import IngestConfig, Ingestor
from broker_adapter.keys import Keys
from broker_adapter.publisher import Publisher
from broker_adapter.store import TaskStore, open_database
from broker_adapter.streams import connect, text
from tests.support.ingest_script import drain, envelope, pending_total, task_counts
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

PASSWORDS = {"alice": "alice-pw", "bob": "bob-pw"}


@pytest.fixture
def acl_users(fresh_redis: RedisServer, prefix: str) -> Iterator[dict[str, redis.Redis]]:
    """One Redis user per principal, allowed only XADD on its own key pattern."""
    admin = fresh_redis.client()
    keys = Keys(prefix)
    clients: dict[str, redis.Redis] = {}
    for principal, password in PASSWORDS.items():
        pattern = keys.inbound(principal).rsplit(":", 1)[0] + ":*"  # {p}:{in.P}:*
        admin.execute_command(  # type: ignore[no-untyped-call]
            "ACL", "SETUSER", principal, "reset", "on", f">{password}",
            f"~{pattern}", "resetchannels", "-@all", "+xadd",
        )  # fmt: skip
        clients[principal] = connect(
            f"redis://{principal}:{password}@127.0.0.1:{fresh_redis.port}/0"
        )
    yield clients
    for c in clients.values():
        c.close()
    admin.close()


def test_acl_principal_cannot_write_another_principals_stream(
    acl_users: dict[str, redis.Redis], prefix: str
) -> None:
    keys = Keys(prefix)
    alice = acl_users["alice"]
    fields = unsigned_fields(envelope("m1", sender="bob"))
    # NOPERM (redis-py turns the error code into NoPermissionError)
    with pytest.raises(redis.exceptions.NoPermissionError, match="no permissions"):
        alice.xadd(keys.inbound("bob"), fields)  # type: ignore[arg-type]
    with pytest.raises(redis.exceptions.NoPermissionError, match="no permissions"):
        alice.xadd(keys.inbound(), fields)  # type: ignore[arg-type]  # nor the shared stream
    # through the library: a publisher for bob on alice's connection is refused by Redis
    with pytest.raises(BrokerAdapterError, match="no permissions"):
        Publisher(alice, keys, "bob", None).publish(envelope("m1", sender="bob"))
    assert text(alice.xadd(keys.inbound("alice"), unsigned_fields(envelope("m1"))))  # type: ignore[arg-type]


def test_acl_ingest_charges_entries_to_the_streams_principal(
    acl_users: dict[str, redis.Redis],
    fresh_redis: RedisServer,
    prefix: str,
    tmp_path: Path,
    clock: FakeClock,
) -> None:
    keys = Keys(prefix)
    alice, bob = acl_users["alice"], acl_users["bob"]
    alice_pub = Publisher(alice, keys, "alice", None)
    assert alice_pub.stream == keys.inbound("alice")
    for i in range(4):
        alice_pub.publish(envelope(f"m{i}"))
    Publisher(bob, keys, "bob", None).publish(envelope("m0", sender="bob"))
    # alice writes her own stream (allowed) but claims to be bob in the body
    alice.xadd(keys.inbound("alice"), unsigned_fields(envelope("m9", sender="bob")))  # type: ignore[arg-type]

    client = connect(fresh_redis.url)
    tasks = TaskStore(open_database(tmp_path / "inbox.db"), clock)
    config = IngestConfig(
        prefix=prefix,
        consumer="ingest-acl-0",
        mode="acl",
        acl_principals=("alice", "bob"),
        block_ms=20,
    )
    ingestor = Ingestor(config, client, tasks, None, clock=clock)
    drain(ingestor, client)

    expected = {("alice", f"m{i}"): 1 for i in range(4)} | {("bob", "m0"): 1}
    assert task_counts(tasks) == expected  # no ("bob", "m9"): the body alone proves nothing
    dead = cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(keys.inbound_dead("alice")))
    assert [(f[b"dl.reason"], f[b"dl.principal"]) for _, f in dead] == [
        (b"sender_mismatch", b"alice")
    ]
    assert client.xlen(keys.inbound_dead("bob")) == 0
    for p in ("alice", "bob"):
        assert pending_total(client, keys.inbound(p)) == 0
