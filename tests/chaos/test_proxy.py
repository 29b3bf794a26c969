"""The chaos proxy's fault modes against a real redis-server (a few seconds)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from broker_adapter.redis.client import connect
from tests.chaos.proxy import ChaosProxy
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.chaos


@pytest.fixture
def proxied(fresh_redis: RedisServer) -> Iterator[tuple[RedisServer, ChaosProxy, redis.Redis]]:
    proxy = ChaosProxy(fresh_redis.port)
    proxy.start()
    client = connect(proxy.url, socket_timeout_s=1.0)
    try:
        yield fresh_redis, proxy, client
    finally:
        client.close()
        proxy.stop()


def test_proxy_passes_commands_through(
    proxied: tuple[RedisServer, ChaosProxy, redis.Redis],
) -> None:
    _, _, client = proxied
    assert client.ping()
    client.set("k", "v")
    assert client.get("k") == b"v"


def test_proxy_drop_reply_once_runs_the_command_but_loses_its_reply(
    proxied: tuple[RedisServer, ChaosProxy, redis.Redis],
) -> None:
    server, proxy, client = proxied
    proxy.drop_reply_once(b"XADD")
    with pytest.raises(redis.ConnectionError):
        client.xadd("s", {"a": "1"})
    direct = server.client()
    try:
        assert direct.xlen("s") == 1  # executed, yet the client saw an error: ambiguous
    finally:
        direct.close()
    assert client.xadd("s", {"a": "2"})  # once only; the client reconnects
    assert proxy.stats["reply_dropped"] == 1


def test_proxy_delay_slows_every_round_trip(
    proxied: tuple[RedisServer, ChaosProxy, redis.Redis],
) -> None:
    _, proxy, client = proxied
    client.ping()
    proxy.delay(0.2)
    started = time.monotonic()
    client.ping()
    assert time.monotonic() - started >= 0.35  # request and reply each wait
    proxy.heal()
    started = time.monotonic()
    client.ping()
    assert time.monotonic() - started < 0.2


def test_proxy_blackhole_times_out_and_heal_restores(
    proxied: tuple[RedisServer, ChaosProxy, redis.Redis],
) -> None:
    _, proxy, client = proxied
    client.ping()
    proxy.blackhole()
    with pytest.raises(redis.TimeoutError):
        client.ping()
    proxy.heal()
    assert client.ping()


def test_proxy_reset_after_bytes_cuts_a_reply(
    proxied: tuple[RedisServer, ChaosProxy, redis.Redis],
) -> None:
    _, proxy, client = proxied
    client.set("big", "x" * 1000)
    proxy.reset_after_bytes(10)
    with pytest.raises(redis.ConnectionError):
        client.get("big")
    assert client.get("big") == b"x" * 1000
    assert proxy.stats["cut_fired"] == 1


def test_proxy_survives_a_redis_restart(
    proxied: tuple[RedisServer, ChaosProxy, redis.Redis],
) -> None:
    server, proxy, client = proxied
    client.set("k", "v")
    server.kill()
    with pytest.raises(redis.ConnectionError):
        client.get("k")
    server.restart()
    assert client.get("k") == b"v"  # AOF always
    assert proxy.reset_all() >= 0
