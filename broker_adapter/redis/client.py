"""Redis clients and the translation of redis-py's errors into the library's.

Redis writes are never re-sent by the client library (``Retry(NoBackoff(), 0)``): a write
whose reply was lost may or may not have happened, and only the caller, knowing what is
idempotent, decides to try again. Every redis-py error becomes a ``broker_adapter`` error
here (``translated``), with ``raise ... from``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any, TypeAlias, TypeVar

import redis
from pydantic import AfterValidator
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry

from broker_adapter.errors import (
    BrokerAdapterError,
    ConfigError,
    GroupMissingError,
    RedisUnavailable,
)
from broker_adapter.redis import cluster

if TYPE_CHECKING:
    import redis.asyncio

    #: The client class of ``connect_async``, for annotations only (``redis.asyncio`` is
    #: imported by ``connect_async``, when it is called).
    AsyncRedis: TypeAlias = redis.asyncio.Redis

T = TypeVar("T")

#: The client class of ``connect``, for annotations outside this package (which alone
#: imports ``redis``).
Redis = redis.Redis


def check_redis_url(url: str) -> str:
    """``url`` if redis-py can connect by it (``redis://``, ``rediss://`` or ``unix://``,
    a numeric port, a numeric database; or a cluster's seed node, ``redis+cluster://``
    or ``rediss+cluster://``: see ``cluster``).

    Raises:
        ConfigError: why it cannot; the message never repeats the URL (it may hold a
            password).
    """
    if not isinstance(url, str):
        raise ConfigError("bad Redis URL: must be a string")
    plain = cluster.node_url(url) if cluster.is_cluster_url(url) else url
    if not plain.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(
            "bad Redis URL: must start with redis://, rediss://, unix:// or redis+cluster://"
        )
    try:
        parse_url(plain)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise ConfigError(f"bad Redis URL: {exc}") from None
    return url


#: A Redis URL field of a settings model (``check_redis_url``).
RedisUrl = Annotated[str, AfterValidator(check_redis_url)]


def connect(
    url: str, *, socket_timeout_s: float = 10.0, connect_timeout_s: float = 5.0
) -> redis.Redis:
    """A redis-py client that never re-sends a command by itself.

    Args:
        url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``); a cluster's
            ``redis+cluster://host:port`` gives a ``RedisCluster`` (``cluster``).
        socket_timeout_s: per-command socket timeout; must exceed any BLOCK used on it.
        connect_timeout_s: TCP connect timeout.

    Raises:
        ConfigError: a malformed ``url`` (``check_redis_url``).
        RedisUnavailable: a cluster none of whose seed nodes answered (a cluster client
            reads the slot map when it is made; a single Redis's connects at its first
            command).
    """
    check_redis_url(url)
    if cluster.is_cluster_url(url):
        options = _client_options(socket_timeout_s, connect_timeout_s)
        return cluster.connect_cluster(url, options)  # type: ignore[return-value]
    return redis.Redis.from_url(
        url, retry=Retry(NoBackoff(), 0), **_client_options(socket_timeout_s, connect_timeout_s)
    )


def connect_async(
    url: str, *, socket_timeout_s: float = 10.0, connect_timeout_s: float = 5.0
) -> redis.asyncio.Redis:
    """The ``redis.asyncio`` twin of ``connect``: a client that never re-sends a command.

    Args:
        url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``).
        socket_timeout_s: per-command socket timeout; must exceed any BLOCK used on it.
        connect_timeout_s: TCP connect timeout.

    Raises:
        ConfigError: a malformed ``url`` (``check_redis_url``).
    """
    import redis.asyncio
    from redis.asyncio.retry import Retry as AsyncRetry

    check_redis_url(url)
    if cluster.is_cluster_url(url):
        return cluster.connect_cluster_async(url, socket_timeout_s, connect_timeout_s)  # type: ignore[no-any-return]
    return redis.asyncio.Redis.from_url(
        url,
        retry=AsyncRetry(NoBackoff(), 0),
        **_client_options(socket_timeout_s, connect_timeout_s),
    )


def _client_options(socket_timeout_s: float, connect_timeout_s: float) -> dict[str, Any]:
    """What ``connect`` and ``connect_async`` share besides their retry object."""
    return {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "retry_on_timeout": False,
        "health_check_interval": 0,
    }


@contextmanager
def translated() -> Iterator[None]:
    """Translate redis-py exceptions into the library's error tree."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise RedisUnavailable(f"redis unavailable: {exc}") from exc
    except cluster.TRANSIENT_CLUSTER_ERRORS as exc:  # redis-py strips their code words
        raise RedisUnavailable(f"redis cluster: {type(exc).__name__}: {exc}") from exc
    except redis.ResponseError as exc:
        text = str(exc)
        if text.startswith(("NOGROUP", "UNBLOCKED")):
            # UNBLOCKED: the stream was deleted (DEL, FLUSHALL) under a blocking read; its
            # group went with it, so it is the lost-group case (recreate from 0, go on).
            raise GroupMissingError(text) from exc
        if text.startswith(("LOADING", "BUSY ", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN")):
            raise RedisUnavailable(text) from exc
        raise BrokerAdapterError(f"redis error: {text}") from exc
    except redis.RedisError as exc:
        raise RedisUnavailable(f"redis error: {exc}") from exc
    except redis.exceptions.RedisClusterException as exc:
        raise cluster.translate(exc) from exc


def call(fn: Callable[[], T]) -> T:
    """Run one Redis call with errors translated."""
    with translated():
        return fn()


def text(value: bytes | str) -> str:
    """A Redis reply's bytes as text (undecodable bytes replaced)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
