"""Redis Cluster: the ``redis+cluster://`` client and the routed twin of ``exchange``.

``--redis redis+cluster://host:port`` (or ``rediss+cluster://``) selects redis-py's
``RedisCluster`` client, seeded from that one node (it discovers the others). What changes
against one Redis:

* Keyed commands sent through the client's methods are routed by redis-py, which follows
  MOVED (it refreshes its slot map) and ASK (ASKING, then the command, on the target). A
  connection failure refreshes the slot map and is raised, never re-sent
  (``Retry(NoBackoff(), 0)``, as on one Redis): the caller's retry loop sends it again
  after a backoff, by then to the promoted replica.
* The hot paths' pipelined round trips (``internals.exchange``) go through
  ``routed_exchange``: the commands are grouped by the master that serves their slot, one
  exchange per master on that master's own connection pool (with the same raw replies),
  and a command answered MOVED or ASK (it did not run) is sent again where the answer
  points, up to ``REDIRECTS`` times. Commands of one slot keep their order; commands of
  different slots may run on different masters in any order, and after a connection
  failure any subset of them may have run (the callers treat a failed round trip as "any
  of it may have run" already).
* The reader's ``prefetch`` (a read sent ahead on a connection held across calls) is off:
  a held connection would not follow a slot that moves. A peeking ``ack`` still reads the
  next batch in its XACK's round trip.
* Every Lua script names only keys of one hash tag (see ``protocol.keys``), so each runs
  on one master; redis-py checks that for ``Script`` calls, ``routed_exchange`` for
  EVALSHA.
* The dispatcher's data-loss watch reads ``cluster_server_info``: every master's
  ``run_id``, so a failover of any master reads as a restart. The epoch key lives on one
  master: a wipe is seen for that master only.
* A cluster client reads the slot map when it is made: ``connect`` fails
  (``RedisUnavailable``) while no seed node answers, where a single Redis's client
  connects at its first command.

Data a master acknowledged but had not yet replicated is lost when it dies and its
replica is promoted (Redis replication is asynchronous): see README "Scaling out".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    RedisClusterException,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.retry import Retry

from broker_adapter.errors import BrokerAdapterError, ConfigError, RedisUnavailable

#: The URL schemes that select the cluster client, and the plain scheme each stands for.
CLUSTER_SCHEMES = {"redis+cluster://": "redis://", "rediss+cluster://": "rediss://"}
#: How often one command may be redirected (MOVED/ASK) before the round trip gives up
#: (redis-py's own limit is 16).
REDIRECTS = 16

#: Error replies of a cluster in motion (a redirect redis-py did not follow, a slot being
#: migrated, a failover in progress): transient, whatever redis-py calls them.
TRANSIENT_CLUSTER_ERRORS = (AskError, TryAgainError, ClusterDownError)

log = logging.getLogger("broker_adapter.redis.cluster")

#: ``exchange(client, commands, raise_errors=..., raw=...)`` on one node's client.
Exchange = Callable[..., list[Any]]


def is_cluster_url(url: str) -> bool:
    return isinstance(url, str) and url.startswith(tuple(CLUSTER_SCHEMES))


def node_url(url: str) -> str:
    """The plain ``redis://`` (``rediss://``) URL of a ``redis+cluster://`` seed node."""
    for scheme, plain in CLUSTER_SCHEMES.items():
        if url.startswith(scheme):
            return plain + url[len(scheme) :]
    raise ConfigError("bad Redis URL: not a redis+cluster:// URL")


def is_cluster(client: object) -> bool:
    """Whether ``client`` is a cluster client (``connect`` of a ``redis+cluster://`` URL)."""
    return isinstance(client, RedisCluster)


def connect_cluster(url: str, options: dict[str, Any]) -> RedisCluster:
    """A ``RedisCluster`` client seeded from the node of ``url`` that never re-sends a
    command by itself (MOVED and ASK answers are followed: those commands did not run).

    Args:
        url: ``redis+cluster://[user:password@]host:port`` (no database: a cluster has
            only database 0).
        options: the socket options ``client.connect`` gives every client.

    Raises:
        RedisUnavailable: no node answered: unlike a single Redis's client, a cluster's
            reads the slot map when it is made, so its seed node must answer then (the
            adapter's stages and ``receive`` retry it: ``backoff.call_until_stopped``).
    """
    try:
        return RedisCluster.from_url(node_url(url), retry=Retry(NoBackoff(), 0), **options)
    except (redis.RedisError, RedisClusterException) as exc:
        raise RedisUnavailable(f"redis cluster unreachable: {exc}") from exc


def connect_cluster_async(url: str, socket_timeout_s: float, connect_timeout_s: float) -> Any:
    """The ``redis.asyncio`` twin of ``connect_cluster`` (it reads the slot map at its
    first command)."""
    import redis.asyncio
    from redis.asyncio.retry import Retry as AsyncRetry

    return redis.asyncio.RedisCluster.from_url(
        node_url(url),
        retry=AsyncRetry(NoBackoff(), 0),
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
    )


def socket_timeout(client: Any) -> float | None:
    """The per-command socket timeout of a client from ``connect`` (cluster or not)."""
    if is_cluster(client):
        kwargs = client.nodes_manager.connection_kwargs
    else:
        kwargs = client.connection_pool.connection_kwargs
    timeout = kwargs.get("socket_timeout")
    return None if timeout is None else float(timeout)


def translate(exc: RedisClusterException) -> BrokerAdapterError:
    """The library error for a redis-py cluster exception (not a ``RedisError``): an
    unserved slot is transient (a failover in progress), anything else a bug (keys of
    several slots in one command)."""
    if isinstance(exc, SlotNotCoveredError):
        return RedisUnavailable(f"redis cluster: {exc}")
    return BrokerAdapterError(f"redis cluster error: {exc}")


def cluster_server_info(client: Any) -> dict[str, Any]:
    """``INFO server`` of the cluster as one server, for the dispatcher's data-loss watch:
    ``run_id`` joins every master's (so a failover, a restarted master or a master added
    changes it, and the replies sent just before are published again), ``uptime_in_seconds``
    and ``redis_version`` are the lowest of them.

    Raises:
        redis.RedisError: a master could not be asked (the slot map is refreshed).
    """
    try:
        per_node = client.info("server", target_nodes=RedisCluster.PRIMARIES)
    except (redis.ConnectionError, redis.TimeoutError):
        client.nodes_manager.initialize()
        raise
    infos = list(per_node.values()) if isinstance(per_node, dict) else [per_node]
    if infos and not isinstance(infos[0], dict):  # one node: its reply itself
        infos = [per_node]
    return {
        "run_id": ",".join(sorted(str(i.get("run_id", "")) for i in infos)),
        "uptime_in_seconds": min(float(i.get("uptime_in_seconds", 0)) for i in infos),
        "redis_version": min((str(i.get("redis_version", "0")) for i in infos), key=_version),
    }


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


# -- routing ----------------------------------------------------------------------------


def command_keys(command: Sequence[Any]) -> Sequence[Any]:
    """The keys of one command as the hot paths send them (stream commands, EVALSHA, EVAL
    and FCALL); other commands are taken to have their key first, or none."""
    name = str(command[0]).upper()
    if name in ("EVALSHA", "EVAL", "FCALL", "FCALL_RO"):
        return command[3 : 3 + int(command[2])]
    if name in ("XREADGROUP", "XREAD"):
        upper = [str(a).upper() if isinstance(a, str) else a for a in command]
        at = upper.index("STREAMS") + 1
        return command[at : at + (len(command) - at) // 2]
    if name in ("INFO", "PING", "SCRIPT", "FUNCTION", "ASKING", "TIME"):
        return ()
    return command[1:2]


def command_slot(command: Sequence[Any]) -> int | None:
    """The one slot of ``command``'s keys, or None for a keyless command.

    Raises:
        BrokerAdapterError: its keys lie in several slots (a key layout bug).
    """
    slots = {key_slot(_as_bytes(k)) for k in command_keys(command)}
    if len(slots) > 1:
        raise BrokerAdapterError(f"redis cluster: keys of {command[0]} span slots {slots}")
    return slots.pop() if slots else None


def _as_bytes(key: Any) -> bytes:
    return key if isinstance(key, bytes) else str(key).encode("utf-8")


def routed_exchange(
    client: RedisCluster,
    commands: Sequence[Sequence[Any]],
    send: Exchange,
    *,
    raise_errors: bool = True,
    raw: bool = False,
) -> list[Any]:
    """``exchange`` on a cluster: one ``send`` per master serving the commands' slots, in
    the order the commands' slots first appear; MOVED and ASK answers are followed.

    A keyless command (INFO) goes to the master of the batch's first keyed command (for
    the data-loss watch, the master of the epoch key), or the default node.

    Raises:
        redis.RedisError: as ``exchange`` (a connection failure also refreshes the slot
            map first, so that the caller's next attempt finds the promoted replica).
    """
    slots = [command_slot(c) for c in commands]
    anchor = next((s for s in slots if s is not None), None)
    replies: list[Any] = [None] * len(commands)
    # (command index, the node an ASK named, or None: the slot's master)
    todo: list[tuple[int, ClusterNode | None]] = [(i, None) for i in range(len(commands))]
    for _ in range(REDIRECTS):
        groups: dict[str, tuple[ClusterNode, list[tuple[int, bool]]]] = {}
        for i, asked in todo:
            node = asked or _master(client, slots[i] if slots[i] is not None else anchor)
            groups.setdefault(node.name, (node, []))[1].append((i, asked is not None))
        todo = []
        for node, items in groups.values():
            batch: list[Sequence[Any]] = []
            for i, asking in items:
                batch += [("ASKING",), commands[i]] if asking else [commands[i]]
            try:
                out = send(client.get_redis_connection(node), batch, raise_errors=False, raw=raw)
            except (redis.ConnectionError, redis.TimeoutError):
                _refresh(client, node)
                raise
            at = 0
            for i, asking in items:
                at += asking  # the ASKING's own +OK
                reply = out[at]
                at += 1
                if isinstance(reply, MovedError):
                    client.nodes_manager.move_slot(reply)
                    todo.append((i, None))
                elif isinstance(reply, AskError):
                    todo.append((i, _node(client, reply.host, int(reply.port))))
                else:
                    replies[i] = reply
        if not todo:
            break
    else:
        raise TryAgainError(f"redis cluster: still redirected after {REDIRECTS} tries")
    if raise_errors:
        raise_first_error(replies)
    return replies


def raise_first_error(replies: list[Any]) -> None:
    """Raise the first error reply among ``replies``, if any."""
    for reply in replies:
        if isinstance(reply, redis.ResponseError):
            raise reply


def _master(client: Any, slot: int | None) -> ClusterNode:
    if slot is None:
        node = client.get_default_node()
        if node is None:  # pragma: no cover - a started client always has one
            raise SlotNotCoveredError("redis cluster: no default node")
        return node  # type: ignore[no-any-return]
    return client.nodes_manager.get_node_from_slot(slot)  # type: ignore[no-any-return]


def _node(client: Any, host: str, port: int) -> ClusterNode:
    """The node an ASK answer names (added to the client's table when new)."""
    node = client.get_node(host=host, port=port)
    if node is None:
        client.nodes_manager.initialize()
        node = client.get_node(host=host, port=port)
    if node is None:
        raise SlotNotCoveredError(f"redis cluster: ASK to unknown node {host}:{port}")
    return node  # type: ignore[no-any-return]


def _refresh(client: RedisCluster, failed: ClusterNode) -> None:
    """After a connection failure: reload the slot map, trying ``failed`` last (best
    effort: until the node's replica is promoted the map still names it)."""
    try:
        client.nodes_manager.initialize(last_failed_node_name=failed.name)
    except (redis.RedisError, RedisClusterException) as exc:
        log.warning("redis cluster: slot map refresh failed: %s", exc)
