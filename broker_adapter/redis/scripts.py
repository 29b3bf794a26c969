"""Lua scripts of the reader, and running a script many times in one round trip.

Each script's source is a constant here with a header stating its KEYS and ARGV. Scripts
run by ``eval_many`` go by EVALSHA (``script_sha``) and are loaded on NOSCRIPT.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import redis

from broker_adapter.errors import BrokerAdapterError
from broker_adapter.redis.client import translated
from broker_adapter.redis.internals import exchange

#: Dead-letter one entry: XADD the dead letter to the dead stream and XACK the source
#: entry, atomically.
#:
#: KEYS[1] the source stream, KEYS[2] its dead-letter stream.
#: ARGV[1] the group, ARGV[2] the entry id (``0-0``: acknowledge nothing, the entry left
#: the pending list already), ARGV[3..] the dead letter's field/value pairs
#: (``protocol.deadletter.entry_fields``): a few notes and at most ``max_entry_fields``
#: copied fields, so ``unpack`` stays bounded.
#: Returns the dead letter's entry id.
DEAD_LETTER = """
local dead_id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return dead_id
"""


@functools.lru_cache(maxsize=64)
def script_sha(source: str) -> str:
    """The SHA-1 Redis files a script under (what EVALSHA takes); computed once per script
    (a worker publishing one reply per batch hashed the whole script every time)."""
    return hashlib.sha1(source.encode("utf-8")).hexdigest()


def _as_error(exc: redis.ResponseError) -> BrokerAdapterError:
    """The translated error of an error reply, as an instance (for a result slot)."""
    try:
        with translated():
            raise exc
    except BrokerAdapterError as out:
        return out


def eval_many(
    client: redis.Redis,
    source: str,
    calls: Sequence[tuple[Sequence[str], Sequence[bytes | str | int]]],
) -> list[Any]:
    """Run one Lua script once per ``(keys, args)`` call, pipelined in ONE round trip.

    A call the server refused (a script error, WRONGTYPE, OOM) gets the translated error
    *instance* in its result slot instead of failing its neighbours. Calls refused with
    NOSCRIPT (first use on a server, or a restart emptied the script cache) did not run:
    the script is loaded and only those calls are sent again.

    Returns:
        one result per call, in order: the script's reply or a ``BrokerAdapterError``.

    Raises:
        RedisUnavailable: the round trip failed; any prefix of the calls may have run.
    """
    sha = script_sha(source)
    results: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for attempt in range(2):
        with translated():
            replies = exchange(
                client,
                [("EVALSHA", sha, len(calls[i][0]), *calls[i][0], *calls[i][1]) for i in todo],
                raise_errors=False,
            )
        missing: list[int] = []
        for i, reply in zip(todo, replies, strict=True):
            if isinstance(reply, redis.exceptions.NoScriptError) and attempt == 0:
                missing.append(i)
            elif isinstance(reply, redis.ResponseError):
                results[i] = _as_error(reply)
            else:
                results[i] = reply
        if not missing:
            break
        with translated():
            client.script_load(source)
        todo = missing
    return results
