"""The private redis-server the tests run on (``broker_adapter.redis.server``), and the rule
for a missing binary: skip locally, fail in CI. Never touches the shared Redis on 6379."""

from __future__ import annotations

import os

from broker_adapter.redis.server import REDIS_BINARY, RedisServer, binary_available, free_port

__all__ = ["REDIS_BINARY", "RedisServer", "binary_available", "free_port", "require_binary"]


def require_binary() -> None:
    """Skip locally, fail in CI, when redis-server is missing."""
    import pytest

    if binary_available():
        return
    if os.environ.get("CI"):
        pytest.fail("redis-server is not installed; .ci/run should have installed it")
    pytest.skip("redis-server binary not found")
