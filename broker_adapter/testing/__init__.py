"""Helpers for the tests of applications built on broker_adapter.

- ``RedisServer``: a private ``redis-server`` on a free loopback port with a data directory
  of its own (never a Redis you did not start).
- ``TaskRunner``: a router's task run in process by the worker's own code, on a fake clock
  and a store of its own, without Redis.
- ``RunningAdapter``: a real ``broker-adapter run`` process, ready when its group exists.
- ``write_keyring``: a keyring file with fresh secrets, mode 0600, as ``Keyring.load`` and
  ``broker-adapter run --keyring`` want it.
- The pytest plugin (``broker_adapter.testing.pytest_plugin``, loaded by pytest on its own
  once broker_adapter is installed) gives the fixtures ``ba_redis_server``, ``ba_redis_url``,
  ``ba_prefix``, ``ba_keyring``, ``ba_adapter`` and ``ba_client``; docs/AGENTS.md shows
  them in a test.

Nothing here is imported by ``import broker_adapter``: it is for tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker_adapter.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from broker_adapter.redis.server import RedisServer, binary_available, free_port
    from broker_adapter.testing.adapter import RunningAdapter
    from broker_adapter.testing.keyrings import write_keyring
    from broker_adapter.testing.runner import TaskRunner

#: Each public name, and the module and attribute it is read from when first used.
_EXPORTS: dict[str, tuple[str, str]] = {
    "binary_available": ("broker_adapter.redis.server", "binary_available"),
    "free_port": ("broker_adapter.redis.server", "free_port"),
    "RedisServer": ("broker_adapter.redis.server", "RedisServer"),
    "RunningAdapter": ("broker_adapter.testing.adapter", "RunningAdapter"),
    "TaskRunner": ("broker_adapter.testing.runner", "TaskRunner"),
    "write_keyring": ("broker_adapter.testing.keyrings", "write_keyring"),
}

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

__all__ = [
    "RedisServer",
    "RunningAdapter",
    "TaskRunner",
    "binary_available",
    "free_port",
    "write_keyring",
]
