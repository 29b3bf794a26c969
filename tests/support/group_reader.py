"""GroupReader helpers shared by the contract tests and the fault tests of the reader."""

from __future__ import annotations

from typing import Any

import redis

from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.reader import GroupReader
from broker_adapter.redis.reader_config import ReaderConfig
from tests.support.backends import Backend


def make_reader(
    backend: Backend, prefix: str, consumer: str, **cfg: int
) -> tuple[GroupReader, Any]:
    """A reader of group ``g`` on ``prefix``'s inbound stream (BLOCK 50 ms) on a client of
    its own; returns it and that client. ``cfg``: ``ReaderConfig`` options."""
    keys = Keys(prefix)
    client = backend.connect()
    group_reader = GroupReader(
        client,
        keys.inbound(),
        "g",
        consumer,
        keys.inbound_dead(),
        ReaderConfig(block_ms=50, **cfg),
    )
    return group_reader, client


def fill(group_reader: GroupReader, client: redis.Redis, n: int) -> None:
    """Create the group, add ``n`` entries ``{"n": i}`` and end the replay of the (empty)
    own pending list."""
    group_reader.ensure_group()
    for i in range(n):
        client.xadd(group_reader.stream, {"n": str(i)})
    assert group_reader.read() == []  # own pending list empty: from now on new entries


def numbers(entries: list[Any]) -> list[int]:
    """The ``n`` of each entry."""
    return [int(e.fields[b"n"]) for e in entries]


def prefetching(
    backend: Backend, prefix: str, n: int, count: int = 2
) -> tuple[GroupReader, Any, list[Any]]:
    """A reader (batches of ``count``) over ``n`` entries that read its first batch and sent
    the read of the next (``prefetch``: a whole batch came); returns it, its client and that
    first batch."""
    group_reader, client = make_reader(backend, prefix, "c1", count=count)
    fill(group_reader, client, n)
    first = group_reader.read()
    assert group_reader.prefetch()
    return group_reader, client, first
