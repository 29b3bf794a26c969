"""Running a Lua script many times in one round trip.

Each script's source is a constant in its own module with a header stating its KEYS and
ARGV. Scripts run by ``eval_many`` go by EVALSHA (``script_sha``) and are loaded on NOSCRIPT.
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
