"""The metrics exporter's own looks at Redis: the consumer groups' pending counts and lag,
the streams' lengths, and the readiness PING. Reads only, on a client with short timeouts;
errors come out translated (``BrokerAdapterError``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis

from broker_adapter.errors import BrokerAdapterError
from broker_adapter.redis import cluster
from broker_adapter.redis.client import connect, text, translated


@dataclass
class StreamSample:
    """What ``sample_groups`` saw, and when (``time.monotonic``)."""

    at: float
    groups: list[tuple[str, str, int, int | None]]  # stream, group, pending, lag
    lengths: list[tuple[str, int]]


def redis_client(url: str, timeout_s: float) -> Any:
    """A client for the exporter's own looks: connect and socket timeouts of ``timeout_s``
    (a cluster's for a ``redis+cluster://`` URL).

    Raises:
        RedisUnavailable: a cluster none of whose seed nodes answered.
    """
    if cluster.is_cluster_url(url):
        return connect(url, socket_timeout_s=timeout_s, connect_timeout_s=timeout_s)
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


def sample_groups(client: Any, streams: Iterable[str]) -> StreamSample:
    """``XINFO GROUPS`` and ``XLEN`` of each stream (a stream not made yet has none).

    Raises:
        BrokerAdapterError: Redis failed (translated).
    """
    groups: list[tuple[str, str, int, int | None]] = []
    lengths: list[tuple[str, int]] = []
    with translated():
        for stream in streams:
            if not client.exists(stream):
                continue
            lengths.append((stream, int(client.xlen(stream))))
            for g in client.xinfo_groups(stream):
                lag = g.get("lag")
                groups.append(
                    (stream, text(g["name"]), int(g["pending"]), None if lag is None else int(lag))
                )
    return StreamSample(time.monotonic(), groups, lengths)


def redis_check(url: str, timeout_s: float) -> Callable[[], str | None]:
    """A readiness check: PING within ``timeout_s``; the problem, or ``None``."""

    def check() -> str | None:
        client = redis_client(url, timeout_s)
        try:
            with translated():
                client.ping()
        except BrokerAdapterError as exc:
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            return f"redis: {type(cause).__name__}: {cause}"
        finally:
            client.close()
        return None

    return check
