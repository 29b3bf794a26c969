"""The screening function's Lua: the Redis Function library that measures entries inside Redis.

The library ``ba_screen_1`` (loaded with ``FUNCTION LOAD REPLACE`` by ``screening``, which
calls it) takes the entries one at a time inside Redis and

* returns an entry only if it has at most ``max_fields`` fields and ``max_bytes`` bytes,
  and only while the entries returned so far fit in ``budget`` bytes (the first always
  does): the reader never receives more than ``max(budget, max_bytes)`` bytes of entries
  per read, all of them measured;
* dead-letters a larger entry (or one of more fields) on the server, in the same atomic
  call: a dead letter with the reader's notes (``dl.reason`` ``oversize`` or
  ``too_many_fields``, ``dl.detail``, ``dl.source``, ``dl.entry_id``, ``dl.deliveries``,
  ``dl.group``, ``dl.consumer``, ``dl.field``, ``dl.truncated``) and a prefix of the entry
  of at most ``copy_bytes`` bytes (the format of ``protocol.deadletter``), then XACK;
* takes the entries 16 at a time (``CHUNK``) and stops once it has looked at ``budget``
  bytes, so that Redis itself holds at most the budget and one chunk in the script's
  memory per call (a 256-entry batch costs 16 reads inside Redis, not 256).

A read of new entries of an inbound stream moves the stream's submit list into it first,
in the same call (the Lua of ``admission``, spliced in).

The functions are flagged ``allow-oom``: a reader must keep reading (and acknowledging, and
dead-lettering with a bounded copy) when Redis is at ``maxmemory``.
"""

from __future__ import annotations

from broker_adapter.redis.admission import ADMIT_LUA

#: The function library's name (its version is part of it: two versions of the adapter
#: sharing a Redis during an upgrade each call their own).
LIBRARY = "ba_screen_1"
READ_FUNCTION = "ba_screen_read_1"
CLAIM_FUNCTION = "ba_screen_claim_1"

#: The library (Lua). Both functions take KEYS[1] the stream, KEYS[2] its dead-letter
#: stream, and ARGV: 1 group, 2 consumer, 3 count, 4 max_fields, 5 max_bytes, 6 budget,
#: 7 copy_bytes, 8 max_deliveries, 9 the start (read: ``>`` or an id; claim: the cursor),
#: 10 (claim only) the minimum idle time, ms. They return
#: ``{cursor, left, entries, refused, deleted}``:
#: ``cursor`` the takeover's next cursor (``""`` for reads), ``left`` 1 when an entry was
#: delivered but not returned (the budget was spent), ``entries`` as XREADGROUP returns
#: them, ``refused`` ``{id, reason, detail}`` per entry dead-lettered here, ``deleted`` the
#: ids XAUTOCLAIM found deleted.
#:
#: The read takes an optional KEYS[3], the stream's submit list, with ARGV 10 the most
#: items to move and 11 the most bytes of one item: before reading, it moves items from
#: the list into the stream (``admit``: XADD with ``*``; an item that is not a JSON array
#: of an even number of strings, has too many fields or bytes is dead-lettered instead,
#: with a bounded prefix copy) and adds a sixth element to its reply,
#: ``{admitted, refused reasons, more, error}``. Commands inside: LPOP, LPUSH (an item
#: whose XADD failed goes back), LLEN on KEYS[3], XADD on KEYS[1] and KEYS[2].
SOURCE = r"""#!lua name=ba_screen_1

local function measure(fields)
  local size = 0
  for i = 1, #fields do size = size + #fields[i] end
  return size
end

-- A bounded prefix of flat name/value pairs: {orig.<name>, value, ...}, and the bytes copied.
local function prefix_copy(fields, max_fields, copy_bytes)
  local copy = {}
  local room = copy_bytes
  local last = math.min(#fields - 1, 2 * max_fields)
  for i = 1, last, 2 do
    if room <= 0 then break end
    local name = string.sub(fields[i], 1, room)
    local value = string.sub(fields[i + 1], 1, room - #name)
    room = room - #name - #value
    copy[#copy + 1] = 'orig.' .. name
    copy[#copy + 1] = value
  end
  return copy, copy_bytes - room
end

-- The dead letter of an entry refused here: notes, then a bounded prefix copy; then XACK.
-- Returns the reason written (past the delivery limit, that one).
local function refuse(stream, dead, a, id, fields, size, reason, detail)
  local deliveries = 1
  local pend = redis.call('XPENDING', stream, a.group, id, id, 1)
  if pend[1] then deliveries = pend[1][4] end
  if deliveries > a.max_deliveries then  -- the reader's order: the delivery limit first
    reason = 'delivery_limit'
    detail = 'delivered ' .. deliveries .. ' times, limit ' .. a.max_deliveries
  end
  local out = {'dl.reason', reason, 'dl.detail', detail, 'dl.source', stream,
               'dl.entry_id', id, 'dl.deliveries', tostring(deliveries),
               'dl.group', a.group, 'dl.consumer', a.consumer, 'dl.field', ''}
  local copy, copied = prefix_copy(fields, a.max_fields, a.copy_bytes)
  out[#out + 1] = 'dl.truncated'
  out[#out + 1] = 'copied ' .. (#copy / 2) .. ' of ' .. math.floor(#fields / 2) ..
    ' fields, ' .. copied .. ' of ' .. size .. ' bytes; the entry stays in ' ..
    stream .. ' under dl.entry_id until the stream is trimmed past it'
  for i = 1, #copy do out[#out + 1] = copy[i] end
  redis.call('XADD', dead, '*', unpack(out))
  redis.call('XACK', stream, a.group, id)
  return reason
end

-- Entries are taken this many at a time: what one call holds at once is the budget and
-- one such chunk.
local CHUNK = 16

-- The entries of an XREADGROUP reply: {{stream, entries}} (Redis), or {stream, entries}
-- (fakeredis, which the fast tests run).
local function entries_of(reply)
  if not reply then return {} end
  local items = reply[2]
  if type(reply[1]) == 'table' then items = reply[1][2] end
  return items or {}
end

local function args(argv)
  return {group = argv[1], consumer = argv[2], count = tonumber(argv[3]),
          max_fields = tonumber(argv[4]), max_bytes = tonumber(argv[5]),
          budget = tonumber(argv[6]), copy_bytes = tonumber(argv[7]),
          max_deliveries = tonumber(argv[8])}
end

-- Look at one entry: keep it, refuse it, or leave it (budget spent). Returns false when
-- the call must stop taking entries.
local function screen(keys, a, st, entry)
  local id, fields = entry[1], entry[2]
  if not fields then
    st.entries[#st.entries + 1] = entry   -- deleted payload: the reader dead-letters it
    return true
  end
  local size = measure(fields)
  st.seen = st.seen + size
  local n = #fields / 2
  if n > a.max_fields then
    local reason = refuse(keys[1], keys[2], a, id, fields, size, 'too_many_fields',
                          'entry has ' .. math.floor(n) .. ' fields, limit ' .. a.max_fields)
    st.refused[#st.refused + 1] = {id, reason}
  elseif size > a.max_bytes then
    local reason = refuse(keys[1], keys[2], a, id, fields, size, 'oversize',
                          'entry is ' .. size .. ' bytes, limit ' .. a.max_bytes)
    st.refused[#st.refused + 1] = {id, reason}
  elseif #st.entries > 0 and st.taken + size > a.budget then
    st.left = 1                          -- delivered, stays pending: the replay returns it
    return false
  else
    st.taken = st.taken + size
    st.entries[#st.entries + 1] = entry
  end
  return st.seen < a.budget
end

-- (admit: the submit list, ADMIT_LUA of redis.admission)
local function read(keys, argv)
  local a = args(argv)
  local start = argv[9]
  local admitted = nil
  if keys[3] then
    a.admit, a.item_bytes = tonumber(argv[10]), tonumber(argv[11])
    admitted = admit(keys, a)
  end
  local st = {entries = {}, refused = {}, taken = 0, seen = 0, left = 0}
  local pos = start
  local done = 0
  while done < a.count do
    local n = math.min(CHUNK, a.count - done)
    local items = entries_of(redis.call('XREADGROUP', 'GROUP', a.group, a.consumer,
                                        'COUNT', n, 'STREAMS', keys[1], pos))
    local go = true
    for i = 1, #items do
      if start ~= '>' then pos = items[i][1] end
      if go then
        go = screen(keys, a, st, items[i])
      else
        st.left = 1  -- delivered with its chunk, not looked at: the replay returns it
      end
    end
    done = done + #items
    if not go or #items < n then break end
  end
  return {'', st.left, st.entries, st.refused, {}, admitted}
end

local function claim(keys, argv)
  local a = args(argv)
  local cursor = argv[9]
  local st = {entries = {}, refused = {}, taken = 0, seen = 0, left = 0}
  local deleted = {}
  for _ = 1, a.count do
    local reply = redis.call('XAUTOCLAIM', keys[1], a.group, a.consumer, argv[10], cursor,
                             'COUNT', 1)
    cursor = reply[1]
    for _, id in ipairs(reply[3] or {}) do deleted[#deleted + 1] = id end
    local entry = reply[2][1]
    local go = true
    if entry then go = screen(keys, a, st, entry) end
    if not go or cursor == '0-0' then break end
  end
  return {cursor, st.left, st.entries, st.refused, deleted}
end

redis.register_function{function_name = 'ba_screen_read_1', callback = read,
                        flags = {'allow-oom'}}
redis.register_function{function_name = 'ba_screen_claim_1', callback = claim,
                        flags = {'allow-oom'}}
""".replace("-- (admit: the submit list, ADMIT_LUA of redis.admission)\n", ADMIT_LUA)
