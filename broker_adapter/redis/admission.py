"""Admission: what moves an inbound stream's submit list into the stream, inside Redis.

Agents never write an inbound stream (an ``XADD`` lets its sender choose the entry id, and
one at the largest id stops every later ``XADD *`` for everyone on the stream). They RPUSH
the entry's fields to the stream's submit list (``Keys.submit_for``) as a JSON array of
strings, names and values in turn (docs/PROTOCOL.md section 3). The screened read of new
entries (``screening``, function ``ba_screen_read_1`` called with the list as KEYS[3])
first runs ``admit`` below, in the same atomic call:

* it pops up to ``count`` items, stopping once it took ``budget`` bytes (the first item
  always), and adds each with ``XADD <stream> *``: the server picks every id;
* an item that is not such an array (``bad_item``), has more than ``max_fields`` fields
  (``too_many_fields``), more than ``max_bytes`` bytes of fields, or is longer than
  ``ITEM_EXPANSION`` times that before decoding (``oversize``), is dead-lettered instead,
  with the reader's notes, ``dl.submit`` (the list), ``dl.entry_id`` ``""`` and a prefix of
  at most ``copy_bytes`` bytes of its fields (or of the item); it never enters the stream.
  When even a minimal dead letter cannot be written the item is dropped and the reply
  says so (``dropped:<reason>``: the reader raises an alarm);
* an item the stream refuses (a stream at the largest id, a key of another type) goes back
  to the head of its list and the call reports the error: nothing is lost, and the next
  read tries again.

Popping and adding happen in one function call, so a reader that dies loses no item.
The reply's sixth element is ``{admitted, refused reasons, more, error}`` (``Admitted``).
Commands inside: LPOP, LPUSH, LLEN on the list, XADD on the stream and its dead-letter
stream; a user without them gets the call refused before anything moved
(``admission_refused``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from broker_adapter.errors import BrokerAdapterError, TransientError
from broker_adapter.redis.client import text, translated
from broker_adapter.redis.internals import exchange

if TYPE_CHECKING:
    import redis

#: A submit-list item may be this many times ``max_bytes`` long before it is refused
#: unparsed: JSON's longest escape (``\\u0000``) writes one byte as six.
ITEM_EXPANSION = 6

#: The Lua of ``admit`` (and its helpers), part of the screening library: it uses that
#: library's ``measure`` and ``prefix_copy``.
ADMIT_LUA = r"""
-- The fields of a submit-list item (a JSON array of an even number of strings: names and
-- values), or nil, the reason and a detail.
local function item_fields(item, a)
  if #item > a.item_bytes then
    return nil, 'oversize', 'item is ' .. #item .. ' bytes, limit ' .. a.item_bytes
  end
  local ok, fields = pcall(cjson.decode, item)
  if not ok or type(fields) ~= 'table' or #fields < 2 or #fields % 2 ~= 0 then
    return nil, 'bad_item', 'not a JSON array of an even number of strings'
  end
  for i = 1, #fields do
    if type(fields[i]) ~= 'string' then
      return nil, 'bad_item', 'element ' .. i .. ' is not a string'
    end
  end
  local n = #fields / 2
  if n > a.max_fields then
    return fields, 'too_many_fields', 'entry has ' .. n .. ' fields, limit ' .. a.max_fields
  end
  local size = measure(fields)
  if size > a.max_bytes then
    return fields, 'oversize', 'entry is ' .. size .. ' bytes, limit ' .. a.max_bytes
  end
  return fields, nil, nil
end

-- The dead letter of a refused submit-list item (never added to the stream): notes and a
-- bounded prefix of its fields (or of the item itself when it has none). Returns false
-- when neither it nor a minimal one could be written.
local function refuse_item(keys, a, item, fields, reason, detail)
  local notes = {'dl.reason', reason, 'dl.detail', detail, 'dl.source', keys[1],
                 'dl.entry_id', '', 'dl.deliveries', '0', 'dl.group', a.group,
                 'dl.consumer', a.consumer, 'dl.field', '', 'dl.submit', keys[3]}
  local copy, copied
  if fields and reason ~= 'bad_item' then
    copy, copied = prefix_copy(fields, a.max_fields, a.copy_bytes)
  else
    copy, copied = prefix_copy({'item', item}, 1, a.copy_bytes)
  end
  local out = {}
  for i = 1, #notes do out[#out + 1] = notes[i] end
  out[#out + 1] = 'dl.truncated'
  out[#out + 1] = 'copied ' .. copied .. ' of ' .. #item .. ' bytes of the item, ' ..
    'removed from ' .. keys[3]
  for i = 1, #copy do out[#out + 1] = copy[i] end
  local r = redis.pcall('XADD', keys[2], '*', unpack(out))
  if type(r) == 'table' and r.err then
    r = redis.pcall('XADD', keys[2], '*', 'dl.reason', 'internal_error',
                    'dl.failed_reason', reason, 'dl.detail', 'the ' .. reason ..
                    ' dead letter failed: ' .. tostring(r.err), 'dl.field', '',
                    'dl.source', keys[1], 'dl.entry_id', '', 'dl.submit', keys[3])
    if type(r) == 'table' and r.err then return false end
  end
  return true
end

-- Move up to a.admit items of the submit list KEYS[3] into the stream KEYS[1] (XADD with
-- '*': the server picks the id), the refused ones into KEYS[2] instead, stopping once
-- a.budget bytes of items were taken. An item whose XADD fails goes back to the head.
-- Returns {admitted, refused reasons, more left, error or ''}.
local function admit(keys, a)
  local admitted, refused, taken, err = 0, {}, 0, ''
  for _ = 1, a.admit do
    local item = redis.pcall('LPOP', keys[3])
    if type(item) == 'table' and item.err then
      -- A key of another type is reported; a refused right stops the call.
      if not string.find(item.err, 'WRONGTYPE', 1, true) then error(item) end
      err = item.err
      break
    end
    if not item then break end
    taken = taken + #item
    local fields, reason, detail = item_fields(item, a)
    if reason then
      if not refuse_item(keys, a, item, fields, reason, detail) then
        reason = 'dropped:' .. reason  -- not even a minimal dead letter: the reader alarms
      end
      refused[#refused + 1] = reason
    else
      local r = redis.pcall('XADD', keys[1], '*', unpack(fields))
      if type(r) == 'table' and r.err then
        redis.call('LPUSH', keys[3], item)
        err = tostring(r.err)
        break
      end
      admitted = admitted + 1
    end
    if taken >= a.budget then break end
  end
  local left = redis.pcall('LLEN', keys[3])
  local more = (type(left) == 'number' and left > 0) and 1 or 0
  return {admitted, refused, more, err}
end
"""


@dataclass(frozen=True)
class Admitted:
    """What a read moved from the submit list into its stream before reading.

    Attributes:
        count: items added to the stream.
        refused: the reason of each item dead-lettered instead (``dropped:<reason>``:
            not even a minimal dead letter could be written).
        more: items are still waiting in the list.
        error: why the last item could not be added (it went back to the head), or ``""``.
    """

    count: int
    refused: list[str]
    more: bool
    error: str


def parse_admitted(reply: Any) -> Admitted | None:
    """The ``Admitted`` of the sixth element of a read's raw reply (None: no list)."""
    if not reply:
        return None
    count, reasons, more, error = reply
    return Admitted(int(count), [text(r) for r in reasons or ()], bool(more), text(error))


def admission_refused(exc: BaseException) -> bool:
    """Whether a read that moves a submit list was refused for want of a right (a command
    refused inside the function: "The user executing the script can't run this command",
    or ``NOPERM`` for the FCALL itself)."""
    said = str(exc).lower()  # redis-py drops the NOPERM code word from its message
    return any(
        w in said
        for w in ("noperm", "no permissions", "unknown command", "user executing the script can't")
    )


def wait_for_item(
    client: redis.Redis, submit: str, block_ms: int, stream: str, log: logging.Logger
) -> bool:
    """Wait up to ``block_ms`` for an item in the list ``submit``, without taking it:
    ``BLMOVE <list> <list> RIGHT RIGHT`` puts the last item back where it was (nothing
    leaves Redis, the order stays) and returns at once when the list holds one. Its reply
    is that item: ONE item the reader did not measure, bounded by the server's
    ``proto-max-bulk-len`` like a plain blocking read's entry. Returns False (after an
    alarm) when this user may not run ``BLMOVE``: wait on ``stream`` instead.

    Raises:
        RedisUnavailable: the call failed.
    """
    command = ("BLMOVE", submit, submit, "RIGHT", "RIGHT", f"{block_ms / 1000:.3f}")
    try:
        with translated():
            exchange(client, [command], raw=True)
    except TransientError:
        raise
    except BrokerAdapterError as exc:
        if not admission_refused(exc):
            raise
        log.error(
            "ALARM: cannot wait on %s (%s): an idle reader waits on %s instead, and wakes "
            "up for published entries only after block_ms. Grant the reader's Redis user "
            "+blmove (docs/PROTOCOL.md section 9)",
            submit,
            exc,
            stream,
        )
        return False
    return True
