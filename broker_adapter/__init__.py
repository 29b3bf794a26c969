"""broker_adapter: hand work between AI agents over Redis Streams, once.

Agents publish signed envelopes to a Redis stream; a consumer group ingests them into a
local SQLite inbox (deduplicated by authenticated principal and message id); leased, fenced
workers run handlers and commit each terminal result together with its reply
(transactional outbox); a dispatcher publishes replies that an idempotent receiver applies
exactly once.

Everything a user needs is importable from here::

    from broker_adapter import Adapter, AdapterConfig, Client, Envelope, Keyring, connect

Each name is imported the first time it is used (``lazy_exports``): an agent that only
publishes loads the client, not the worker pool.

The sub-packages (``protocol``, ``redis``, ``store``, ``handler``, ``client``, ``stages``,
``app``) are the implementation, layered as docs/ARCHITECTURE.md describes; their names may
move between minor versions, the names below do not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker_adapter.lazy_exports import lazy_exports

__version__ = "0.1.0"

if TYPE_CHECKING:
    from broker_adapter.app.adapter import Adapter
    from broker_adapter.app.adapter_config import AdapterConfig
    from broker_adapter.client.publisher import AsyncPublisher, Publisher
    from broker_adapter.client.request import AsyncClient, Client
    from broker_adapter.clock import Clock, FakeClock, SystemClock
    from broker_adapter.errors import (
        AuthError,
        BrokerAdapterError,
        ConfigError,
        EnvelopeError,
        FencedError,
        GroupMissingError,
        RedisUnavailable,
        ReplyConflict,
        RequestCancelled,
        RequestConflict,
        RequestError,
        RequestExpired,
        RequestFailed,
        RequestHopLimit,
        RequestTimeout,
        RetryableError,
        StageError,
        StaleError,
        StoreBusy,
        StoreError,
        TaskCancelled,
        TransientError,
    )
    from broker_adapter.fences import SqlFence, TargetFenced
    from broker_adapter.handler.effects import Observation, side_effect
    from broker_adapter.handler.router import RouteError, Router, validate_payload
    from broker_adapter.handler.task import Task
    from broker_adapter.protocol.canonical import canonical_json
    from broker_adapter.protocol.envelope import Envelope
    from broker_adapter.protocol.idempotency import action_key
    from broker_adapter.protocol.keys import Keys
    from broker_adapter.protocol.reply import BadReply, Reply
    from broker_adapter.protocol.signing import Keyring
    from broker_adapter.redis.client import connect, connect_async
    from broker_adapter.stages.receiver.receiver import Receiver, ReceiverConfig, effect_key
    from broker_adapter.store import ReceiptStore, open_database
    from broker_adapter.store.outbox_types import UnknownReply
    from broker_adapter.store.task_types import UnknownTask

#: Each public name, and the module and attribute it is read from when first used.
_EXPORTS: dict[str, tuple[str, str]] = {
    "action_key": ("broker_adapter.protocol.idempotency", "action_key"),
    "Adapter": ("broker_adapter.app.adapter", "Adapter"),
    "AdapterConfig": ("broker_adapter.app.adapter_config", "AdapterConfig"),
    "AsyncClient": ("broker_adapter.client.request", "AsyncClient"),
    "AsyncPublisher": ("broker_adapter.client.publisher", "AsyncPublisher"),
    "AuthError": ("broker_adapter.errors", "AuthError"),
    "BadReply": ("broker_adapter.protocol.reply", "BadReply"),
    "BrokerAdapterError": ("broker_adapter.errors", "BrokerAdapterError"),
    "canonical_json": ("broker_adapter.protocol.canonical", "canonical_json"),
    "Client": ("broker_adapter.client.request", "Client"),
    "Clock": ("broker_adapter.clock", "Clock"),
    "ConfigError": ("broker_adapter.errors", "ConfigError"),
    "connect": ("broker_adapter.redis.client", "connect"),
    "connect_async": ("broker_adapter.redis.client", "connect_async"),
    "effect_key": ("broker_adapter.stages.receiver.receiver", "effect_key"),
    "Envelope": ("broker_adapter.protocol.envelope", "Envelope"),
    "EnvelopeError": ("broker_adapter.errors", "EnvelopeError"),
    "FakeClock": ("broker_adapter.clock", "FakeClock"),
    "FencedError": ("broker_adapter.errors", "FencedError"),
    "GroupMissingError": ("broker_adapter.errors", "GroupMissingError"),
    "Keyring": ("broker_adapter.protocol.signing", "Keyring"),
    "Keys": ("broker_adapter.protocol.keys", "Keys"),
    "Observation": ("broker_adapter.handler.effects", "Observation"),
    "open_database": ("broker_adapter.store", "open_database"),
    "Publisher": ("broker_adapter.client.publisher", "Publisher"),
    "ReceiptStore": ("broker_adapter.store", "ReceiptStore"),
    "Receiver": ("broker_adapter.stages.receiver.receiver", "Receiver"),
    "ReceiverConfig": ("broker_adapter.stages.receiver.receiver", "ReceiverConfig"),
    "RedisUnavailable": ("broker_adapter.errors", "RedisUnavailable"),
    "Reply": ("broker_adapter.protocol.reply", "Reply"),
    "ReplyConflict": ("broker_adapter.errors", "ReplyConflict"),
    "RequestCancelled": ("broker_adapter.errors", "RequestCancelled"),
    "RequestConflict": ("broker_adapter.errors", "RequestConflict"),
    "RequestError": ("broker_adapter.errors", "RequestError"),
    "RequestExpired": ("broker_adapter.errors", "RequestExpired"),
    "RequestFailed": ("broker_adapter.errors", "RequestFailed"),
    "RequestHopLimit": ("broker_adapter.errors", "RequestHopLimit"),
    "RequestTimeout": ("broker_adapter.errors", "RequestTimeout"),
    "RetryableError": ("broker_adapter.errors", "RetryableError"),
    "RouteError": ("broker_adapter.handler.router", "RouteError"),
    "Router": ("broker_adapter.handler.router", "Router"),
    "side_effect": ("broker_adapter.handler.effects", "side_effect"),
    "SqlFence": ("broker_adapter.fences", "SqlFence"),
    "StageError": ("broker_adapter.errors", "StageError"),
    "StaleError": ("broker_adapter.errors", "StaleError"),
    "StoreBusy": ("broker_adapter.errors", "StoreBusy"),
    "StoreError": ("broker_adapter.errors", "StoreError"),
    "SystemClock": ("broker_adapter.clock", "SystemClock"),
    "TargetFenced": ("broker_adapter.fences", "TargetFenced"),
    "Task": ("broker_adapter.handler.task", "Task"),
    "TaskCancelled": ("broker_adapter.errors", "TaskCancelled"),
    "TransientError": ("broker_adapter.errors", "TransientError"),
    "UnknownReply": ("broker_adapter.store.outbox_types", "UnknownReply"),
    "UnknownTask": ("broker_adapter.store.task_types", "UnknownTask"),
    "validate_payload": ("broker_adapter.handler.router", "validate_payload"),
}


if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

__all__ = [
    "Adapter",
    "AdapterConfig",
    "AsyncClient",
    "AsyncPublisher",
    "AuthError",
    "BadReply",
    "BrokerAdapterError",
    "Client",
    "Clock",
    "ConfigError",
    "Envelope",
    "EnvelopeError",
    "FakeClock",
    "FencedError",
    "GroupMissingError",
    "Keyring",
    "Keys",
    "Observation",
    "Publisher",
    "ReceiptStore",
    "Receiver",
    "ReceiverConfig",
    "RedisUnavailable",
    "Reply",
    "ReplyConflict",
    "RequestCancelled",
    "RequestConflict",
    "RequestError",
    "RequestExpired",
    "RequestFailed",
    "RequestHopLimit",
    "RequestTimeout",
    "RetryableError",
    "RouteError",
    "Router",
    "SqlFence",
    "StageError",
    "StaleError",
    "StoreBusy",
    "StoreError",
    "SystemClock",
    "TargetFenced",
    "Task",
    "TaskCancelled",
    "TransientError",
    "UnknownReply",
    "UnknownTask",
    "__version__",
    "action_key",
    "canonical_json",
    "connect",
    "connect_async",
    "effect_key",
    "open_database",
    "side_effect",
    "validate_payload",
]
