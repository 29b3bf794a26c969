"""Where each consumer group of a stream stands, as Lua for the scripts that must not pass
an entry some group still needs (``trimming``, ``repair``).

A group needs every entry after its last-delivered id, and every entry it holds pending
(delivered, not acknowledged): its oldest pending entry when it has one, else the entries
after its last-delivered id. The oldest of these over all groups is the stream's bound.

``GROUP_POSITIONS_LUA`` is a prefix: a script is ``GROUP_POSITIONS_LUA + <its body>``, and
the body calls the two local functions it defines:

* ``older(a, b)``: whether stream id ``a`` comes before ``b`` (both ``<ms>-<seq>``, compared
  as numbers of any length, without Lua's floating-point numbers);
* ``group_positions(key)``: the groups of stream ``key`` (``XINFO GROUPS``), each as
  ``{name, last-delivered id, oldest pending id or false}``, then the bound's id (``nil``
  when the stream has no group) and whether the entry at the bound is itself needed (a
  pending one) rather than only the entries after it.
"""

from __future__ import annotations

GROUP_POSITIONS_LUA = """
local function older(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if #am ~= #bm then return #am < #bm end
  if am ~= bm then return am < bm end
  if #as ~= #bs then return #as < #bs end
  return as < bs
end
local function group_positions(key)
  local groups, bound, needed = {}, nil, false
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', key)) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    local last, oldest = info['last-delivered-id'], false
    if tonumber(info['pending']) > 0 then
      oldest = redis.call('XPENDING', key, info['name'])[2]
    end
    groups[#groups + 1] = {info['name'], last, oldest}
    local id, inc = last, false
    if oldest then id, inc = oldest, true end
    if bound == nil or older(id, bound) or (id == bound and inc) then bound, needed = id, inc end
  end
  return groups, bound, needed
end
"""
