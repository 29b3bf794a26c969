"""Running a Lua script many times in one round trip.

Each script's source is a constant in its own module with a header stating its KEYS and
ARGV. Scripts run by ``eval_many`` go by EVALSHA (``script_sha``) and are loaded on NOSCRIPT.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import redis

from broker_adapter.errors import BrokerAdapterError
from broker_adapter.redis.client import translated
from broker_adapter.redis.internals import exchange


@functools.lru_cache(maxsize=64)
def script_sha(source: str) -> str:
    """The SHA-1 Redis files a script under (what EVALSHA takes); computed once per script,
    not once per call."""
    return hashlib.sha1(source.encode("utf-8")).hexdigest()


def as_error(exc: redis.ResponseError) -> BrokerAdapterError:
    """The translated error of an error reply, as an instance (for a result slot)."""
    try:
        with translated():
            raise exc
    except BrokerAdapterError as out:
        return out


#: One call of a script or function: its keys and its other arguments.
Call = tuple[Sequence[str], Sequence[bytes | str | int]]


def call_many(
    client: redis.Redis,
    head: Sequence[Any],
    calls: Sequence[Call],
    *,
    missing: Callable[[redis.ResponseError], bool],
    load: Callable[[list[int], list[Any]], bool],
) -> list[Any]:
    """Send ``head`` + ``numkeys keys... args...`` once per call, pipelined in ONE round
    trip, each result in its slot (a refused call: the translated error *instance*).

    Calls refused because the server lacks the code (``missing``) did not run: ``load``
    gets their indices and the result list, and returns True when the code is now there
    (those calls are sent once more) or False after filling their slots itself.

    Raises:
        RedisUnavailable: the round trip failed; any prefix of the calls may have run.
    """
    results: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for attempt in range(2):
        with translated():
            replies = exchange(
                client,
                [(*head, len(calls[i][0]), *calls[i][0], *calls[i][1]) for i in todo],
                raise_errors=False,
            )
        absent: list[int] = []
        for i, reply in zip(todo, replies, strict=True):
            if isinstance(reply, redis.ResponseError):
                if attempt == 0 and missing(reply):
                    absent.append(i)
                else:
                    results[i] = as_error(reply)
            else:
                results[i] = reply
        if not absent or not load(absent, results):
            break
        todo = absent
    return results


def eval_many(client: redis.Redis, source: str, calls: Sequence[Call]) -> list[Any]:
    """Run one Lua script once per ``(keys, args)`` call, pipelined in ONE round trip
    (``call_many``) by EVALSHA.

    A call the server refused (a script error, WRONGTYPE, OOM) gets the translated error
    *instance* in its result slot instead of failing its neighbours. Calls refused with
    NOSCRIPT (first use on a server, or a restart emptied the script cache) did not run:
    the script is loaded and only those calls are sent again.

    Returns:
        one result per call, in order: the script's reply or a ``BrokerAdapterError``.

    Raises:
        RedisUnavailable: the round trip failed; any prefix of the calls may have run.
    """

    def load(_absent: list[int], _results: list[Any]) -> bool:
        with translated():
            client.script_load(source)
        return True

    return call_many(
        client,
        ("EVALSHA", script_sha(source)),
        calls,
        missing=lambda reply: isinstance(reply, redis.exceptions.NoScriptError),
        load=load,
    )
