"""Result records: the signed reply of a request, kept by message id for a bounded time.

When a terminal reply is published (``stages.shared.publish``), the same script writes the reply
entry's fields (``v``, ``reply_id``, ``hash``, ``body``, ``kid``, ``sig``) into a hash under
``keys.reply_result(P, message_id)`` with a TTL, and adds the message id to the principal's
index ``keys.reply_results(P)`` (a sorted set scored by the publication time, ms). A
requester that restarted, or missed the entry on the stream, reads its reply there
(``client.Client.result``) and checks it like any reply entry.

Bound: one hash per terminal reply (its body plus about 300 bytes) and one index member
(the message id plus about 60 bytes), for at most the result window: the dispatcher's trim
purges records older than the window by its clock (``purge_results``) and the TTL removes
them anyway if no dispatcher runs. Nothing is kept per requester instance.
"""

from __future__ import annotations

from typing import Any

import redis

from broker_adapter.redis.client import text
from broker_adapter.redis.scripts import eval_many

#: Index members purged per script call, and calls per purge at most.
RESULT_PURGE_BATCH = 500
MAX_PURGE_CALLS = 20

#: KEYS[1] the result index; ARGV[1] the records' key prefix (``reply_result(P, "")``),
#: ARGV[2] purge members scored below this (ms, exclusive), ARGV[3] how many at most.
#: Deletes those members' records and the members, atomically (a record published again
#: after the look keeps its newer score and is not touched). Returns how many went.
PURGE_SCRIPT = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[2], 'LIMIT', 0, ARGV[3])
for _, id in ipairs(ids) do
  redis.call('DEL', ARGV[1] .. id)
end
if #ids > 0 then
  redis.call('ZREM', KEYS[1], unpack(ids))
end
return #ids
"""


def purge_results(client: redis.Redis, index: str, record_prefix: str, before_ms: float) -> int:
    """Remove the result records of ``index`` published before ``before_ms`` (ms since the
    epoch, by the publisher's clock), with their index members.

    Args:
        record_prefix: the records' key prefix, ``keys.reply_result(P, "")``.

    Returns:
        how many records went (at most ``RESULT_PURGE_BATCH`` x ``MAX_PURGE_CALLS`` per call).

    Raises:
        RedisUnavailable: Redis could not be reached (each call is atomic and safe to repeat).
        BrokerAdapterError: the server refused.
    """
    removed = 0
    for _ in range(MAX_PURGE_CALLS):
        args: list[bytes | str | int] = [record_prefix, int(before_ms), RESULT_PURGE_BATCH]
        (reply,) = eval_many(client, PURGE_SCRIPT, [([index], args)])
        if isinstance(reply, Exception):
            raise reply
        removed += int(reply)
        if int(reply) < RESULT_PURGE_BATCH:
            break
    return removed


def record_fields(raw: Any) -> dict[bytes, bytes] | None:
    """A result record as ``HGETALL`` returned it, as entry fields; ``None`` if absent."""
    if not raw:
        return None
    return {
        (k if isinstance(k, bytes) else text(k).encode()): (
            v if isinstance(v, bytes) else str(v).encode()
        )
        for k, v in dict(raw).items()
    }
