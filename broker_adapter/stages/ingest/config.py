"""An ingest's settings (``IngestConfig``) and counters (``IngestStats``); see ``ingest``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, field_validator, model_validator

from broker_adapter.config import DEFAULT_CLAIM_MIN_IDLE_MS, ConfigModel
from broker_adapter.protocol.keys import DEFAULT_PREFIX, MAX_PARTITIONS, KeyPrefix, Principal
from broker_adapter.redis.reader import (
    DEFAULT_BLOCK_MS,
    DEFAULT_MAX_DELIVERIES,
    DEFAULT_MAX_ENTRY_FIELDS,
    MAX_COUNT,
    MAX_ENTRY_FIELDS,
    MIN_ENTRY_FIELDS,
)
from broker_adapter.redis.trimming import DEFAULT_TRIM_EVERY_S, DEFAULT_TRIM_KEEP_S
from broker_adapter.store.task_types import DEFAULT_RETENTION_S

DEFAULT_COUNT = 256
DEFAULT_CLAIM_EVERY_S = 5.0
DEFAULT_MAX_ENTRY_BYTES = 256 * 1024
_CONSUMER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")


class IngestConfig(ConfigModel):
    """How an ``Ingestor`` reads.

    Attributes:
        prefix: key prefix (see ``keys``).
        consumer: this process slot's consumer name, stable across restarts (e.g.
            ``ingest-<host>-<slot>``), so a restarted process replays its own pending list.
        mode: ``signed`` (one shared stream, HMAC per entry) or ``acl`` (one stream per
            principal, Redis ACLs decide who may write it).
        acl_principals: the principals whose streams are read in ACL mode.
        partitions: in signed mode, how many inbound partition streams are read
            (``keys.partition_of``; 1, the default, is the one shared stream).
        count: entries per read; one accept transaction and one XACK per batch.
        block_ms: how long a read of new entries blocks (split across streams in ACL mode).
        claim_min_idle_ms: entries idle this long in another consumer's list are taken over.
        claim_every_s: how often ``run`` looks for such entries.
        max_deliveries: entries delivered more often go to the dead-letter stream.
        max_entry_bytes: entries larger than this (all field names and values) are
            dead-lettered as ``oversize`` before any parsing.
        max_entry_fields: entries of more fields than this (repeated names counted) are
            dead-lettered as ``too_many_fields`` before any parsing; a dead letter copies
            at most this many fields (and ``max_entry_bytes`` bytes).
        rate_limit: authenticated entries per second per principal (token bucket, see
            ``limits``); over it they are dead-lettered as ``rate_limited``. ``None``: off.
        rate_burst: the bucket's size (default: one second's worth, at least 1).
        max_open_tasks: a principal with this many tasks not yet terminal gets no new one
            (``quota_exceeded``). ``None``: off.
        retention_s: the retention window, seconds: dead letters older than this are
            trimmed from the dead-letter streams.
        trim_every_s: how often ``run`` trims the inbound and dead-letter streams.
        trim_keep_s: acknowledged inbound entries younger than this (or than
            ``retention_s``, if shorter) are kept, seconds.
    """

    prefix: KeyPrefix = DEFAULT_PREFIX
    consumer: str
    mode: Literal["signed", "acl"] = "signed"
    acl_principals: tuple[Principal, ...] = ()
    partitions: int = Field(default=1, ge=1, le=MAX_PARTITIONS)
    count: int = Field(default=DEFAULT_COUNT, ge=1, le=MAX_COUNT)
    block_ms: int = Field(default=DEFAULT_BLOCK_MS, ge=1)
    claim_min_idle_ms: int = Field(default=DEFAULT_CLAIM_MIN_IDLE_MS, ge=1)
    claim_every_s: float = Field(default=DEFAULT_CLAIM_EVERY_S, gt=0)
    max_deliveries: int = Field(default=DEFAULT_MAX_DELIVERIES, ge=1)
    max_entry_bytes: int = Field(default=DEFAULT_MAX_ENTRY_BYTES, ge=1024)
    max_entry_fields: int = Field(
        default=DEFAULT_MAX_ENTRY_FIELDS, ge=MIN_ENTRY_FIELDS, le=MAX_ENTRY_FIELDS
    )
    rate_limit: float | None = Field(default=None, gt=0)
    rate_burst: int | None = Field(default=None, ge=1)
    max_open_tasks: int | None = Field(default=None, ge=1)
    retention_s: float = Field(default=DEFAULT_RETENTION_S, gt=0)
    trim_every_s: float = Field(default=DEFAULT_TRIM_EVERY_S, gt=0)
    trim_keep_s: float = Field(default=DEFAULT_TRIM_KEEP_S, ge=0)

    @field_validator("consumer")
    @classmethod
    def _consumer(cls, v: str) -> str:
        if not 1 <= len(v) <= 128 or not set(v) <= _CONSUMER_CHARS:
            raise ValueError("consumer must be 1..128 characters of letters, digits, '._:-'")
        return v

    @field_validator("acl_principals")
    @classmethod
    def _principals(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(v)) != len(v):
            raise ValueError("acl_principals lists a principal twice")
        return v

    @model_validator(mode="after")
    def _mode(self) -> IngestConfig:
        if self.mode == "acl" and not self.acl_principals:
            raise ValueError("ACL mode needs acl_principals (whose streams to read)")
        if self.mode == "signed" and self.acl_principals:
            raise ValueError("acl_principals is for ACL mode only")
        if self.mode == "acl" and self.partitions != 1:
            raise ValueError("partitions is for signed mode (ACL mode reads one stream each)")
        return self


@dataclass
class IngestStats:
    """Counters since start. ``dead_lettered`` is by reason, including the reader's own
    (``payload_deleted``, ``delivery_limit``)."""

    batches: int = 0
    entries: int = 0
    accepted: int = 0
    duplicates: int = 0
    conflicts: int = 0
    expired: int = 0
    hop_limited: int = 0
    acked: int = 0
    taken_over: int = 0
    transient_errors: int = 0
    trimmed: int = 0
    dead_letters_trimmed: int = 0
    trim_failures: int = 0
    #: trims that found a group past an id ahead of the server clock (a poisoned stream)
    future_ids: int = 0
    dead_lettered: dict[str, int] = field(default_factory=dict)

    @property
    def dead_lettered_total(self) -> int:
        return sum(self.dead_lettered.values())
