"""Repairing a poisoned stream: one whose ids ran ahead of the server's clock.

A client that may ``XADD`` with an id of its choice can add ``<far future>-0`` or the largest
id, ``18446744073709551615-18446744073709551615``. Every later ``XADD *`` then either gets
ids in the future (trimming by time stops working: see ``trimming``) or fails for good
("the stream has exhausted the last possible ID"). Nothing but a new stream under the same
name undoes that.

``repair_stream`` does it in ONE Lua script on the stream's hash tag, while the adapter
runs:

1. the *live* entries are found: those some group has not acknowledged (pending in it, or
   after its last-delivered id), all entries of a stream without groups;
2. the stream is renamed to ``<stream>:poisoned:<server ms>`` (kept for inspection; delete
   it when done), and the live entries are added again, in order, with ``*`` ids, to a new
   stream under the old name;
3. each group is created again on the new stream at the entry before the first one it still
   needs, so that it reads every entry it had not acknowledged (an entry that was pending
   in it is delivered again: the inbox and the receipts dedupe it; an acknowledged entry
   between two live ones may be delivered again for the same reason).

The running readers go on: their next read finds the group on the new stream; the
acknowledgements of the old ids they still hold match nothing and are harmless. The entries
are copied whole, so the script is bounded by ``max_entries`` (the repair refuses a stream
with more live entries: trim or drain it first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker_adapter.errors import BrokerAdapterError
from broker_adapter.redis.client import text
from broker_adapter.redis.group_positions import GROUP_POSITIONS_LUA
from broker_adapter.redis.scripts import eval_many

if TYPE_CHECKING:
    import redis

#: The most live entries one repair copies (the script runs while Redis serves no one).
DEFAULT_MAX_ENTRIES = 10_000
#: The upper bound an operator may ask for.
MAX_ENTRIES_LIMIT = 1_000_000
#: The most fields of an entry the repair copies (more than any reader accepts).
MAX_FIELDS = 1_000

# KEYS[1] the stream, KEYS[2] the name it is kept under. ARGV[1] the most live entries,
# ARGV[2] the most fields an entry keeps (one of more is copied as one field
# ``repair.dropped_fields``, the reader dead-letters it; Lua's unpack has a limit).
# Returns {status, moved, poisoned name, group1, start1, group2, start2, ...};
# status: 'repaired', 'missing' (no such stream), 'exists' (KEYS[2] taken), 'too_many'
# (moved = how many live entries, at least ARGV[1] + 1).
REPAIR_SCRIPT = (
    GROUP_POSITIONS_LUA
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing', 0, ''} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {'exists', 0, KEYS[2]} end
local limit, max_fields = tonumber(ARGV[1]), tonumber(ARGV[2])
local groups, from, incl = group_positions(KEYS[1])
local range_from = '-'
if from ~= nil then
  if incl then range_from = from else range_from = '(' .. from end
end
local items = {}
if range_from ~= '(18446744073709551615-18446744073709551615' then  -- nothing after the last id
  items = redis.call('XRANGE', KEYS[1], range_from, '+', 'COUNT', limit + 1)
end
if #items > limit then return {'too_many', #items, ''} end
for _, item in ipairs(items) do
  if #item[2] > 2 * max_fields then
    item[2] = {'repair.dropped_fields', tostring(#item[2] / 2)}
  end
end
redis.call('RENAME', KEYS[1], KEYS[2])
local new_ids = {}
for i, item in ipairs(items) do
  new_ids[i] = redis.call('XADD', KEYS[1], '*', unpack(item[2]))
end
local out = {'repaired', #items, KEYS[2]}
for _, g in ipairs(groups) do
  local name, last, pending = g[1], g[2], g[3]
  local start = '$'
  for i, item in ipairs(items) do
    local id = item[1]
    if older(last, id) or (pending and not older(id, pending)) then
      if i == 1 then start = '0' else start = new_ids[i - 1] end
      break
    end
  end
  if start == '$' and #items > 0 then start = new_ids[#items] end
  redis.call('XGROUP', 'CREATE', KEYS[1], name, start, 'MKSTREAM')
  out[#out + 1] = name
  out[#out + 1] = start
end
return out
"""
)


@dataclass(frozen=True)
class RepairResult:
    """What a repair did.

    Attributes:
        moved: live entries copied to the new stream.
        kept_as: the name the poisoned stream is kept under.
        groups: each group created again, and the id it starts after (``0``: from the first
            entry; ``$`` on a stream left empty).
    """

    moved: int
    kept_as: str
    groups: dict[str, str]


def repair_stream(
    client: redis.Redis, stream: str, *, server_ms: int, max_entries: int = DEFAULT_MAX_ENTRIES
) -> RepairResult:
    """Move the live entries of ``stream`` to a fresh stream under the same name (see the
    module text); the poisoned stream stays as ``<stream>:poisoned:<server_ms>``.

    Raises:
        RedisUnavailable: Redis could not be reached (the script is atomic: it ran whole or
            not at all; ask ``XINFO`` which).
        BrokerAdapterError: no such stream, the kept name is taken, more than
            ``max_entries`` live entries, or the server refused.
    """
    if not 1 <= max_entries <= MAX_ENTRIES_LIMIT:
        raise BrokerAdapterError(f"max_entries must be 1..{MAX_ENTRIES_LIMIT}, not {max_entries}")
    kept_as = f"{stream}:poisoned:{server_ms}"
    args = [max_entries, MAX_FIELDS]
    (reply,) = eval_many(client, REPAIR_SCRIPT, [([stream, kept_as], args)])
    if isinstance(reply, Exception):
        raise reply
    status, moved = text(reply[0]), int(reply[1])
    if status == "missing":
        raise BrokerAdapterError(f"no stream {stream!r}")
    if status == "exists":
        raise BrokerAdapterError(f"{kept_as!r} exists already; try again in a millisecond")
    if status == "too_many":
        raise BrokerAdapterError(
            f"{stream!r} has more than {max_entries} live entries; raise --max-entries "
            f"(the script blocks Redis while it copies) or let the adapter drain it first"
        )
    rest = reply[3:]
    groups = {text(rest[i]): text(rest[i + 1]) for i in range(0, len(rest) - 1, 2)}
    return RepairResult(moved=moved, kept_as=text(reply[2]), groups=groups)
