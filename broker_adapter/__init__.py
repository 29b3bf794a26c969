"""broker_adapter: hand work between AI agents over Redis Streams, once.

Agents publish signed envelopes to a Redis stream; a consumer group ingests them into a
local SQLite inbox (deduplicated by authenticated principal and message id); leased, fenced
workers run handlers and commit each terminal result together with its reply
(transactional outbox); a dispatcher publishes replies that an idempotent receiver applies
exactly once.

Everything a user needs is importable from here::

    from broker_adapter import Adapter, AdapterConfig, Client, Envelope, Keyring, connect

The sub-packages (``protocol``, ``redis``, ``store``, ``client``, ``stages``, ``app``) are
the implementation, layered as docs/ARCHITECTURE.md describes; their names may move
between minor versions, the names below do not.
"""

__version__ = "0.1.0"

from broker_adapter.app.adapter import Adapter, AdapterConfig
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
from broker_adapter.protocol.idempotency import effect_key as action_key
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.reply import BadReply, Reply
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect, connect_async
from broker_adapter.stages.receiver.receiver import Receiver, ReceiverConfig, effect_key
from broker_adapter.store import ReceiptStore, open_database
from broker_adapter.store.outbox import UnknownReply
from broker_adapter.store.tasks import UnknownTask

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
