"""Fences at a Redis target: a fenced ``SET`` that refuses a fence lower than the highest
seen for its key (see ``broker_adapter.fences`` for the rule and why).

One Lua script reads the fence key, compares and writes both keys, so no other command runs
between the check and the write: a zombie's late write is refused by the server itself.
The fence key holds the highest fence as a decimal integer; it must be one per task (see
``broker_adapter.fences``), e.g. the value's key, ``":fence:"`` and the task id. Redis
Cluster puts the two keys in one slot only when both carry the same hash tag (``{tag}``).
Fences must stay below 2**53 (Lua compares them as doubles).

Example::

    fenced_set(client, "web1:state", "restarting", task.fence,
               fence_key="web1:state:fence:" + task.task_id)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker_adapter.errors import BrokerAdapterError
from broker_adapter.fences import TargetFenced, check_fence
from broker_adapter.redis.client import text, translated
from broker_adapter.redis.scripts import eval_many

if TYPE_CHECKING:
    import redis

#: Fences at or above this are refused before they reach Lua (its numbers are doubles).
FENCE_LIMIT = 2**53

# KEYS[1] fence key, KEYS[2] value key; ARGV[1] fence, ARGV[2] value, ARGV[3] PX ms or "".
# Returns {1, fence} when written, {0, highest} when refused.
_FENCED_SET = """
local seen = redis.call('GET', KEYS[1])
local fence = tonumber(ARGV[1])
if seen then
  local highest = tonumber(seen)
  if not highest then
    return redis.error_reply('ERR fence key ' .. KEYS[1] .. ' holds no number')
  end
  if fence < highest then
    return {0, seen}
  end
end
redis.call('SET', KEYS[1], ARGV[1])
if ARGV[3] ~= '' then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
else
  redis.call('SET', KEYS[2], ARGV[2])
end
return {1, ARGV[1]}
"""


def fenced_set(
    client: redis.Redis,
    key: str,
    value: bytes | str,
    fence: int,
    *,
    fence_key: str,
    px_ms: int | None = None,
) -> None:
    """``SET key value`` if ``fence`` is not lower than the highest fence seen on
    ``fence_key``, recording ``fence`` as the highest, atomically.

    Args:
        client: the target's Redis.
        key: the value's key.
        value: what to store.
        fence: the writer's fence (``Task.fence``).
        fence_key: where the highest fence is kept: one per task (fences of two tasks are
            not ordered). It never expires.
        px_ms: an expiry for the value, milliseconds.

    Raises:
        TargetFenced: a higher fence was seen; nothing was written.
        ValueError: ``fence`` is not an integer in ``[0, FENCE_LIMIT)``, ``px_ms`` < 1, or
            an empty ``fence_key``.
        RedisUnavailable: the call failed; the write may or may not have happened.
        BrokerAdapterError: the fence key holds something else than a number.
    """
    check_fence(fence)
    if fence >= FENCE_LIMIT:
        raise ValueError(f"fence {fence} is not below {FENCE_LIMIT}")
    if px_ms is not None and px_ms < 1:
        raise ValueError(f"px_ms must be >= 1, got {px_ms}")
    if not fence_key:
        raise ValueError("a fence key must not be empty")
    px = "" if px_ms is None else px_ms
    (reply,) = eval_many(client, _FENCED_SET, [((fence_key, key), (fence, value, px))])
    if isinstance(reply, BrokerAdapterError):
        raise reply
    written, highest = int(reply[0]), int(text(reply[1]))
    if not written:
        raise TargetFenced(fence_key, fence, highest)


def highest_fence(client: redis.Redis, fence_key: str) -> int | None:
    """The highest fence recorded on ``fence_key``, or ``None``."""
    with translated():
        raw = client.get(fence_key)
    return None if raw is None else int(text(raw))
