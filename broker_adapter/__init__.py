"""broker_adapter: hand work between AI agents over Redis Streams, once.

Agents publish signed envelopes to a Redis stream; a consumer group ingests them into a local
SQLite inbox (deduplicated by authenticated principal and message id); leased, fenced workers
run handlers and commit each terminal result together with its reply (transactional outbox);
a dispatcher publishes replies that an idempotent receiver applies exactly once.
"""

from broker_adapter.clock import Clock, FakeClock, SystemClock
from broker_adapter.errors import (
    AuthError,
    BrokerAdapterError,
    ConfigError,
    EnvelopeError,
    FencedError,
    RedisUnavailable,
    RetryableError,
    StageError,
    StaleError,
    StoreBusy,
    StoreError,
    TaskCancelled,
    TransientError,
)
from broker_adapter.protocol.envelope import Envelope, canonical_json

__version__ = "0.1.0"

__all__ = [
    "AuthError",
    "BrokerAdapterError",
    "Clock",
    "ConfigError",
    "Envelope",
    "EnvelopeError",
    "FakeClock",
    "FencedError",
    "RedisUnavailable",
    "RetryableError",
    "StageError",
    "StaleError",
    "StoreBusy",
    "StoreError",
    "SystemClock",
    "TaskCancelled",
    "TransientError",
    "__version__",
    "canonical_json",
]
