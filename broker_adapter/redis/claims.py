"""Single-key claims in Redis: a value set once and kept (a binding), or held for a short
time and renewed by the one who holds it (a lease on a name).

Every call touches one key, so each works the same on a Redis Cluster (the key's slot
decides the node). Values are text (JSON, written by the caller); a holder is recognised
by its whole value, which the caller makes unique (it holds a random token). The scripts
use ``GET``, ``SET`` and ``DEL`` only, on their one key.
"""

from __future__ import annotations

from collections.abc import Iterator

import redis

from broker_adapter.redis.client import call, text, translated
from broker_adapter.redis.scripts import eval_many

#: Renew a held claim: KEYS[1] the claim, ARGV[1] the holder's value, ARGV[2] the TTL, ms.
#: Returns 1 (renewed), 2 (the key was gone: set again) or the value of whoever holds it.
RENEW = """
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if not held then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 2
end
return held
"""

#: Replace a value only if it is still the one seen: KEYS[1] the key, ARGV[1] the value
#: seen, ARGV[2] the new value ('' deletes the key), ARGV[3] the new value's TTL in ms
#: ('0': none). Returns 1 when replaced, 0 when the key holds something else.
SWAP = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
if ARGV[2] == '' then
  redis.call('DEL', KEYS[1])
elseif ARGV[3] == '0' then
  redis.call('SET', KEYS[1], ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return 1
"""


def read(client: redis.Redis, key: str) -> str | None:
    """The value at ``key``, or ``None``."""
    raw = call(lambda: client.get(key))
    return None if raw is None else text(raw)


def set_once(client: redis.Redis, key: str, value: str, ttl_ms: int | None = None) -> str | None:
    """Set ``key`` to ``value`` unless it holds something (``SET NX``, with a TTL if given).

    Returns:
        ``None`` when this call set it, else the value found there.
    """
    while True:
        with translated():
            if client.set(key, value, nx=True, px=ttl_ms):
                return None
            raw = client.get(key)
        if raw is not None:
            return text(raw)
        # gone between the two calls (a claim that just expired, a wipe): try again


def renew(client: redis.Redis, key: str, value: str, ttl_ms: int) -> int | str:
    """Renew the claim ``key`` held with ``value`` for ``ttl_ms`` more (``RENEW``).

    Returns:
        1 renewed, 2 it had lapsed and is held again, or the value of another holder.
    """
    (result,) = eval_many(client, RENEW, [([key], [value, ttl_ms])])
    if isinstance(result, Exception):
        raise result
    return result if isinstance(result, int) else text(result)


def swap(client: redis.Redis, key: str, seen: str, new: str | None, ttl_ms: int = 0) -> bool:
    """Replace ``seen`` at ``key`` by ``new`` (``None``: delete it), only if ``seen`` is
    still there (``SWAP``). Returns whether it was."""
    (result,) = eval_many(client, SWAP, [([key], [seen, new or "", ttl_ms])])
    if isinstance(result, Exception):
        raise result
    return bool(result)


def values(client: redis.Redis, pattern: str) -> Iterator[tuple[str, str]]:
    """``(key, value)`` of every key matching ``pattern`` (``SCAN``; on a cluster, every
    node's), skipping those gone by the time they are read."""
    with translated():
        keys = [text(k) for k in client.scan_iter(match=pattern)]
    for key in keys:
        value = read(client, key)
        if value is not None:
            yield key, value
