"""The Redis Function library of broker_adapter, and calling its functions.

Users that must not run scripts of their own (receivers: a script that loops makes every
client of the server get ``BUSY`` until a restart) still need one atomic step, the dead
letter: XADD to the dead-letter stream and XACK of the source entry, or neither. That step
is a Redis Function in the library ``broker_adapter``, loaded with ``FUNCTION LOAD`` by the
adapter when it starts or by the operator (``broker-adapter functions load``), and called
with ``FCALL``: a user with ``+fcall|ba_dead_letter`` runs it and nothing else, and cannot
load code (no ``script|load``, ``eval*``, ``function``).

Functions run with the rights of the calling user: each command inside is checked like a
command sent directly (a function grants no key or command its caller lacks).

Functions are part of the server's data set: kept in RDB and AOF, copied to replicas,
untouched by ``FLUSHALL``; a server that restarts without persistence has none. A call that
finds none loads the library once if its user may (``function|load``), else fails with the
command to run. On Redis Cluster the library is loaded on every master.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis

from broker_adapter.errors import BrokerAdapterError, TransientError
from broker_adapter.redis import cluster
from broker_adapter.redis.client import translated
from broker_adapter.redis.scripts import Call, call_many

log = logging.getLogger(__name__)

#: The library's name (``FUNCTION LIST LIBRARYNAME broker_adapter``).
LIBRARY_NAME = "broker_adapter"
#: Dead-letter one entry (``redis.dead_lettering``).
DEAD_LETTER = "ba_dead_letter"

#: The library's code. Functions, their KEYS and ARGV:
#:
#: ``ba_dead_letter``: KEYS[1] the source stream, KEYS[2] its dead-letter stream; ARGV[1]
#: the group, ARGV[2] the entry id (``0-0``: acknowledge nothing), ARGV[3] the dead-letter
#: stream's cap (entries; ``0``: no cap), ARGV[4..] the dead letter's field/value pairs.
#: XADDs the dead letter with ``*`` (and ``MAXLEN <cap>``: the oldest entries beyond the
#: cap go), then XACKs the entry. Returns ``{dead letter id, entries trimmed by the cap}``.
#: Commands inside: XLEN, XADD on KEYS[2], XACK on KEYS[1].
LIBRARY = """#!lua name=broker_adapter

local function dead_letter(keys, args)
  local cap, trimmed, dead_id = tonumber(args[3]), 0, nil
  if cap > 0 then
    trimmed = math.max(0, redis.call('XLEN', keys[2]) + 1 - cap)
    dead_id = redis.call('XADD', keys[2], 'MAXLEN', cap, '*', unpack(args, 4))
  else
    dead_id = redis.call('XADD', keys[2], '*', unpack(args, 4))
  end
  redis.call('XACK', keys[1], args[1], args[2])
  return {dead_id, trimmed}
end

redis.register_function('ba_dead_letter', dead_letter)
"""

#: What Redis answers an FCALL of a function it does not have.
_NOT_FOUND = "function not found"
#: How to load the library by hand, for error messages.
LOAD_COMMAND = "broker-adapter functions load --redis <url of a user with +function|load>"


def load_functions(client: redis.Redis) -> None:
    """``FUNCTION LOAD REPLACE`` the library (on every master of a cluster).

    Raises:
        RedisUnavailable: Redis could not be reached.
        BrokerAdapterError: the server refused (``NOPERM`` for a user without
            ``function|load``; a Redis older than 7.0).
    """
    with translated():
        if cluster.is_cluster(client):
            client.function_load(LIBRARY, replace=True)  # redis-py sends it to every master
        else:
            client.execute_command("FUNCTION", "LOAD", "REPLACE", LIBRARY)  # type: ignore[no-untyped-call]


def load_at_start(client: redis.Redis, logger: logging.Logger) -> bool:
    """The adapter's load of the library when it starts: a refusal (a user without
    ``function|load``) or an unreachable Redis is logged, not raised (the operator may have
    loaded it; a call that finds none tries again). Returns whether it was loaded."""
    try:
        load_functions(client)
    except BrokerAdapterError as exc:
        logger.warning(
            "could not load the Redis Function library %s (%s): dead letters need it; "
            "run `%s` if no other process loads it",
            LIBRARY_NAME,
            exc,
            LOAD_COMMAND,
        )
        return False
    return True


def fcall_many(client: redis.Redis, function: str, calls: Sequence[Call]) -> list[Any]:
    """Call ``function`` once per ``(keys, args)``, pipelined in ONE round trip
    (``scripts.call_many``).

    A call the server refused gets the translated error *instance* in its result slot.
    Calls that found no function (a server restarted without persistence, or nobody loaded
    the library yet) are sent again once after ``load_functions``; when the load itself is
    refused, their slots hold an error that names the command to run.

    Raises:
        RedisUnavailable: the round trip failed; any prefix of the calls may have run.
    """

    def load(absent: list[int], results: list[Any]) -> bool:
        try:
            load_functions(client)
        except TransientError:
            raise
        except BrokerAdapterError as exc:
            error = BrokerAdapterError(
                f"Redis has no function {function} and this user cannot load it ({exc}); "
                f"run `{LOAD_COMMAND}`"
            )
            for i in absent:
                results[i] = error
            return False
        log.info("loaded the Redis Function library %s", LIBRARY_NAME)
        return True

    return call_many(
        client,
        ("FCALL", function),
        calls,
        missing=lambda reply: _NOT_FOUND in str(reply).lower(),
        load=load,
    )
