"""The one place that reaches into redis-py's private API, fenced here so that an upgrade of
redis-py has one file to check.

Checked against redis-py 5.0.8 and 8.1.0 (RESP2, with hiredis): the reader, ingest, receiver
and dispatcher integration tests pass on both. What is used:

* ``ConnectionPool.get_connection()`` (before redis-py 5.3 it wants a command name, which
  it ignores), ``ConnectionPool.release``, and on a connection ``pack_commands``,
  ``send_packed_command``, ``send_command``, ``read_response`` and ``disconnect``: one
  connection taken from the pool, commands written in one go, replies read in order.
* ``Redis.parse_response(conn, command_name)``: a reply through the client's response
  callbacks, as ``client.xreadgroup(...)`` would return it.
* The shape of a raw stream reply from ``read_response`` (``reply_entries``,
  ``stream_entries``): lists of ``[id, [name, value, ...]]``; a map of them under RESP3.

Why: on the hot paths (the reader's XREADGROUP and XACK, the reply script) redis-py's
per-command and pipeline layers cost more CPU than the round trip's own work, and its
stream callbacks fold an entry's pairs into a dict, where a repeated name silently keeps
its last value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from broker_adapter.redis import cluster
from broker_adapter.redis.client import text
from broker_adapter.redis.entry import StreamEntry

#: The redis-py major versions this file was checked against; pyproject.toml bounds the
#: dependency to them, and a test fails loudly on any other.
TESTED_REDIS_MAJORS = (5, 6, 7, 8)


def redis_py_major() -> int:
    """The installed redis-py's major version."""
    return int(str(redis.__version__).split(".", 1)[0])


def exchange(
    client: redis.Redis,
    commands: Sequence[Sequence[Any]],
    *,
    raise_errors: bool = True,
    raw: bool = False,
) -> list[Any]:
    """Send ``commands`` in one write on one connection of the client's pool and read their
    replies in order: one round trip, without redis-py's per-command and pipeline layers
    (on the hot paths those cost more CPU than the round trip's own work). Replies go
    through the client's response callbacks, as ``client.xreadgroup(...)`` would return
    them, unless ``raw``. Nothing is ever re-sent.

    Args:
        raise_errors: raise the first error reply after all replies were read; otherwise
            each error reply is left in its slot as its ``redis.ResponseError``.
        raw: leave the replies as the server sent them (stream entries as flat name/value
            lists: see ``reply_entries``).

    Raises:
        redis.RedisError: a connection failure (the connection is closed; any prefix of the
            commands may have run), or an error reply with ``raise_errors``. Callers
            translate (``translated``).
    """
    if cluster.is_cluster(client):
        return cluster.routed_exchange(
            client,  # type: ignore[arg-type]
            commands,
            exchange,
            raise_errors=raise_errors,
            raw=raw,
        )
    pool = client.connection_pool
    conn = pool_connection(pool)
    replies: list[Any] = []
    try:
        conn.send_packed_command(conn.pack_commands(commands))
        for command in commands:
            try:
                if raw:
                    replies.append(conn.read_response())
                else:
                    replies.append(client.parse_response(conn, command[0]))  # type: ignore[no-untyped-call]
            except redis.ResponseError as exc:
                replies.append(exc)
    except BaseException:
        discard(pool, conn)
        raise
    pool.release(conn)
    if raise_errors:
        cluster.raise_first_error(replies)
    return replies


def send_ahead(client: redis.Redis, command: Sequence[Any]) -> Any:
    """Send ``command`` on a connection of its own from the client's pool without reading
    its reply: the connection, for ``read_ahead`` (or ``discard``).

    Raises:
        redis.RedisError: the connection or the send failed (the connection is closed).
    """
    pool = client.connection_pool
    conn = pool_connection(pool)
    try:
        conn.send_command(*command)
    except BaseException:
        discard(pool, conn)
        raise
    return conn


def read_ahead(
    client: redis.Redis, conn: Any, then: Sequence[Any] | None = None
) -> tuple[Any, Any]:
    """The raw reply of the command ``send_ahead`` sent on ``conn``, after sending ``then``
    (if given) on it too, and the raw reply of ``then`` (``None`` without it): one round
    trip for both. ``conn`` goes back to the pool.

    Raises:
        redis.RedisError: the connection failed or a reply was an error (the connection is
            closed: a reply may be unread on it; either command may or may not have run).
    """
    pool = client.connection_pool
    try:
        if then is not None:
            conn.send_command(*then)
        reply = conn.read_response()
        then_reply = conn.read_response() if then is not None else None
    except BaseException:
        discard(pool, conn)
        raise
    pool.release(conn)
    return reply, then_reply


def pool_connection(pool: Any) -> Any:
    """A connection of its own from ``pool`` (redis-py before 5.3 wants a command name)."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("XREADGROUP")


def discard(pool: Any, conn: Any) -> None:
    """Close a connection whose reply may be unread (it cannot be reused as it is) and give
    it back to ``pool``."""
    conn.disconnect()
    pool.release(conn)


def reply_entries(reply: Any) -> list[StreamEntry]:
    """The entries of a raw XREADGROUP reply (RESP2: a list of ``[stream, entries]``;
    RESP3: a map of them), one delivery each."""
    if not reply:
        return []
    streams = reply.items() if isinstance(reply, dict) else reply
    out: list[StreamEntry] = []
    for _stream, items in streams:
        out += stream_entries(items)
    return out


def stream_entries(items: Any) -> list[StreamEntry]:
    """``[[id, [name, value, ...]], ...]`` as entries; nil or empty fields (the payload was
    deleted) become ``fields=None``. A repeated name shows as fewer dict keys than pairs
    (``GroupReader`` refuses the entry)."""
    out: list[StreamEntry] = []
    for eid, pairs in items or ():
        if pairs:
            it = iter(pairs)
            out.append(StreamEntry(text(eid), dict(zip(it, it, strict=False)), 1, pairs))
        else:
            out.append(StreamEntry(text(eid), None, 1, None))
    return out
