"""Stream trimming: how far a stream may be cut without losing an entry someone still needs.

One rule for every stream the adapter trims (the inbound streams by the ingest, the reply
streams by the dispatcher): ``XTRIM <stream> MINID <bound>`` where the bound never passes an
entry that ANY consumer group on the stream has not been delivered yet or still has pending,
whoever owns the group. Computed and applied in ONE Lua script on the stream's key (atomic:
no group can be created, rewound or read from between the look and the cut):

* for every group of ``XINFO GROUPS``: its oldest pending entry (the ``XPENDING`` summary's
  smallest id) if it has any pending, else its ``last-delivered-id``. The bound is the
  smallest of them. Entries before it were delivered to every group and acknowledged by
  every group. The last delivered entry itself stays (MINID keeps ids at or above the bound;
  one entry per stream, and no id arithmetic).
* ``entries-read`` and ``lag`` are not used: both are estimates that Redis may report as nil
  (after ``XGROUP SETID`` without ``ENTRIESREAD``, after deletions), while the last-delivered
  id is exact. A group created at ``0`` that has read nothing has last-delivered ``0-0``,
  which keeps every entry; a dead consumer's pending entries hold the bound at the oldest of
  them until another consumer takes them over and acknowledges them.
* a stream with no group keeps every entry, unless unread entries expire (below).
* ``keep_from_ms``: entries at or after ``<ms>-0`` stay whatever their state (a floor: the
  window during which an acknowledged entry can still be looked at under its id, e.g. the
  original of a truncated dead letter).
* ``expire_before_ms`` (reply streams only): entries before ``<ms>-0`` that some group has
  not acknowledged (or that no group has read, or that are on a stream with no group) go
  too, and are returned, with their ``reply_id`` field, so that the caller counts and logs
  them. Inbound streams never expire entries: an undelivered request stays until read.

Time: entry ids carry the Redis server's clock, the windows are set on the caller's
(``Clock``; a ``FakeClock`` in tests). ``now_ms`` takes the earlier of the two, so a process
clock that runs ahead of the server never trims early; one that runs behind keeps entries
longer by its lag.

Ids ahead of the clock: an ``XADD`` with an explicit id (``9999999999999-0``, or the
largest id) puts an entry in the future, and every later ``*`` id follows it, so no entry
after it would ever be older than the keep floor. The script compares the groups'
last-delivered ids with the server's ``TIME``: when one is more than ``FUTURE_TOLERANCE_MS``
ahead, the stream is *poisoned*: the keep floor and the expiry (both times) are not applied,
acknowledged entries are trimmed up to the groups' bound, and the result names the id
(``TrimResult.future_id``) so that the caller raises the alarm. ``broker-adapter streams
repair`` (``redis.repair``) moves the live entries to a fresh stream.

Rewinds: a group rewound (``XGROUP SETID ... 0``) after a trim reaches back only to the
entries the trim kept.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from broker_adapter.errors import BrokerAdapterError, TransientError
from broker_adapter.redis.client import text, translated
from broker_adapter.redis.group_positions import GROUP_POSITIONS_LUA
from broker_adapter.redis.scripts import eval_many

#: How often the ingest and the dispatcher trim the streams they own, seconds.
DEFAULT_TRIM_EVERY_S = 10.0
#: Acknowledged entries younger than this (or than the retention window, if shorter) stay,
#: seconds: how long the original of a truncated dead letter can still be read.
DEFAULT_TRIM_KEEP_S = 300.0

if TYPE_CHECKING:
    import redis

    from broker_adapter.clock import Clock

#: Expired entries listed per script call (each with its reply id); more take more calls.
EXPIRED_PER_CALL = 100
#: A trim stops after this many calls on one stream (it goes on at its next interval).
MAX_CALLS_PER_TRIM = 100
#: A group's last-delivered id more than this ahead of the server's clock marks the stream
#: as poisoned (ms; room for a clock step between a primary and its replica).
FUTURE_TOLERANCE_MS = 60_000

# KEYS[1] the stream. ARGV[1] keep floor id ("<ms>-0": entries at or above it stay),
# ARGV[2] expiry id ("<ms>-0", or "" never: unacknowledged entries below it go),
# ARGV[3] how many expired entries to list (and trim) in this call, ARGV[4] how many ms a
# last-delivered id may be ahead of the server's TIME before the stream counts as poisoned.
# Returns {trimmed, more, future, id1, reply_id1, id2, reply_id2, ...}: ``more`` is 1 when
# expired entries beyond the listed ones remain; ``future`` is the largest last-delivered id
# ahead of the clock ('' if none): then the keep floor and the expiry are not applied.
# ``read``: the bound is a last-delivered id that every group acknowledged (the entry at it
# is not listed as expired, only trimmed).
TRIM_SCRIPT = (
    GROUP_POSITIONS_LUA
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 0, ''} end
local t = redis.call('TIME')
local horizon = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[4])
local groups, bound, needed = group_positions(KEYS[1])
local read, future = bound ~= nil and not needed, ''
for _, g in ipairs(groups) do
  local b = g[2]
  if tonumber(string.match(b, '^(%d+)-')) > horizon and (future == '' or older(future, b)) then
    future = b
  end
end
if bound == nil then
  if ARGV[2] == '' then return {0, 0, ''} end
  bound = '0-0'
end
local target = bound
if future == '' and older(ARGV[1], target) then target, read = ARGV[1], false end
local out = {0, 0, future}
if ARGV[2] ~= '' and future == '' then
  local cut = ARGV[2]
  if older(ARGV[1], cut) then cut = ARGV[1] end
  if older(target, cut) then
    local limit = tonumber(ARGV[3])
    local from = target
    if read then from = '(' .. target end
    local items = redis.call('XRANGE', KEYS[1], from, '(' .. cut, 'COUNT', limit + 1)
    if #items > limit then
      cut = items[limit + 1][1]
      items[limit + 1] = nil
      out[2] = 1
    end
    for _, item in ipairs(items) do
      local rid = ''
      local f = item[2]
      for i = 1, #f, 2 do
        if f[i] == 'reply_id' then rid = string.sub(f[i + 1], 1, 200) break end
      end
      out[#out + 1] = item[1]
      out[#out + 1] = rid
    end
    target = cut
  end
end
out[1] = redis.call('XTRIM', KEYS[1], 'MINID', target)
return out
"""
)


@dataclass
class TrimResult:
    """What one trim of one stream did.

    Attributes:
        trimmed: entries removed (acknowledged ones and expired ones).
        expired: the expired entries removed, as ``(entry id, reply id)`` (the reply id is
            ``""`` for an entry without one, cut to 200 characters).
        complete: False when the trim stopped at ``MAX_CALLS_PER_TRIM`` calls.
        future_id: a group's last-delivered id ahead of the server's clock (the stream is
            poisoned: the keep floor was not applied), ``""`` when none.
    """

    trimmed: int = 0
    expired: list[tuple[str, str]] = field(default_factory=list)
    complete: bool = True
    future_id: str = ""


def now_ms(client: redis.Redis, clock: Clock) -> float:
    """The trims' "now", ms since the epoch: the earlier of ``clock`` and the server's
    ``TIME``.

    Raises:
        RedisUnavailable: Redis could not be asked.
    """
    with translated():
        seconds, micros = client.time()
    return min(clock.now() * 1000, seconds * 1000 + micros / 1000)


def time_id(ms: float) -> str:
    """The smallest stream id of millisecond ``ms`` (``"<ms>-0"``; 0 for times before 1970)."""
    return f"{max(0, int(ms))}-0"


def trim_stream(
    client: redis.Redis,
    stream: str,
    *,
    keep_from_ms: float,
    expire_before_ms: float | None = None,
) -> TrimResult:
    """Trim ``stream`` up to the oldest entry any group still needs (see the module text).

    Args:
        keep_from_ms: entries stamped at or after this time (ms since the epoch) stay.
        expire_before_ms: unacknowledged entries stamped before this time go too (and are
            listed in the result); ``None``: they stay.

    Raises:
        RedisUnavailable: Redis could not be reached (part of the trim may have happened:
            each call is atomic and safe to repeat).
        BrokerAdapterError: the server refused (an ACL without ``xinfo|groups`` or
            ``xtrim``, a key that is not a stream).
    """
    keep = time_id(keep_from_ms)
    expire = "" if expire_before_ms is None else time_id(expire_before_ms)
    result = TrimResult()
    for _ in range(MAX_CALLS_PER_TRIM):
        args: list[str | int] = [keep, expire, EXPIRED_PER_CALL, FUTURE_TOLERANCE_MS]
        (reply,) = eval_many(client, TRIM_SCRIPT, [([stream], args)])
        if isinstance(reply, Exception):
            raise reply
        trimmed, more, listed = int(reply[0]), int(reply[1]), reply[3:]
        result.future_id = text(reply[2])
        result.trimmed += trimmed
        result.expired += [
            (text(listed[i]), text(listed[i + 1])) for i in range(0, len(listed) - 1, 2)
        ]
        if not more:
            return result
    result.complete = False
    return result


def trim_by_age(client: redis.Redis, stream: str, before_ms: float) -> int:
    """Remove the entries of ``stream`` (a dead-letter stream) stamped before ``before_ms``
    (ms since the epoch), whatever their state; returns how many went."""
    with translated():
        return int(client.xtrim(stream, minid=time_id(before_ms), approximate=False))


def trim_with_dead_letters(
    client: redis.Redis,
    stream: str,
    dead_stream: str,
    *,
    keep_from_ms: float,
    dead_before_ms: float,
    log: logging.Logger,
    expire_before_ms: float | None = None,
) -> tuple[TrimResult, int] | None:
    """``trim_stream`` on ``stream``, then ``trim_by_age`` on its dead-letter stream: the
    periodic trim of the ingest and of the dispatcher.

    Returns:
        the stream's ``TrimResult`` and how many dead letters went; ``None`` when the server
        refused (an ACL without ``xtrim``, say): logged as an alarm, tried again at the next
        interval, never stopping the caller's loop.

    Raises:
        TransientError: Redis could not be reached (each call is atomic and safe to repeat).
    """
    try:
        result = trim_stream(
            client, stream, keep_from_ms=keep_from_ms, expire_before_ms=expire_before_ms
        )
        dead = trim_by_age(client, dead_stream, dead_before_ms)
    except TransientError:
        raise
    except BrokerAdapterError as exc:
        log.error("ALARM: trimming %s failed, will retry: %s", stream, exc)
        return None
    if result.future_id:
        log.error(
            "ALARM: %s holds entries with ids ahead of the server clock (a group has read "
            "%s): some client chose the id; acknowledged entries are trimmed without the keep "
            "window. Repair with `broker-adapter streams repair --stream %s`",
            stream,
            result.future_id,
            stream,
        )
    return result, dead
