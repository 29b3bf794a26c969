"""An ingest's section of the settings tree (``IngestSettings``), its full settings
(``IngestConfig``) and counters (``IngestStats``); see ``ingest``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from broker_adapter.config import (
    DEFAULT_CLAIM_MIN_IDLE_MS,
    RETENTION_SETTING,
    ConfigModel,
    setting,
)
from broker_adapter.metric_fields import (
    DEAD_LETTERS_TRIMMED,
    STREAM_ENTRIES_TRIMMED,
    STREAM_FUTURE_IDS,
    TRIM_FAILURES,
    Family,
)
from broker_adapter.protocol.keys import (
    PARTITIONS_SETTING,
    PREFIX_SETTING,
    KeyPrefix,
    Principal,
)
from broker_adapter.redis.reader_config import (
    BLOCK_MS_SETTING,
    COUNT_SETTING,
    MAX_DELIVERIES_SETTING,
    MAX_ENTRY_FIELDS_SETTING,
)
from broker_adapter.redis.trimming import DEFAULT_TRIM_EVERY_S, DEFAULT_TRIM_KEEP_S

DEFAULT_CLAIM_EVERY_S = 5.0
DEFAULT_MAX_ENTRY_BYTES = 256 * 1024
_CONSUMER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")

#: ``signed``: one stream, an HMAC per entry; ``acl``: one stream per principal.
Mode = Literal["signed", "acl"]


class IngestSettings(ConfigModel):
    """The ingest's section of the settings tree (``AdapterConfig.ingest``): what ``run``
    sets of how requests come in. ``IngestConfig`` extends it with what one ingest needs.

    Attributes:
        mode: ``signed`` (one shared stream, HMAC per entry) or ``acl`` (one stream per
            principal, Redis ACLs decide who may write it).
        acl_principals: the principals whose streams are read in ACL mode.
        partitions: in signed mode, how many inbound partition streams are read
            (``keys.partition_of``; 1, the default, is the one shared stream).
        claim_min_idle_ms: entries idle this long in another consumer's list are taken over
            (at least 1 ms: the takeover scan needs a consumer to have been idle).
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
    """

    mode: Mode = setting(
        "signed",
        help="signed: one stream, an HMAC per entry; acl: one stream per principal, Redis"
        " ACLs decide who writes it",
        flag="--mode",
        env="BA_MODE",
    )
    acl_principals: tuple[Principal, ...] = setting(
        (),
        help="in ACL mode, a principal whose stream is read (repeat the flag; the variable"
        " takes a comma-separated list)",
        flag="--acl-principal",
        env="BA_ACL_PRINCIPALS",
        metavar="P",
    )
    partitions: int = PARTITIONS_SETTING
    claim_min_idle_ms: int = setting(
        DEFAULT_CLAIM_MIN_IDLE_MS,
        ge=1,
        help="pending entries of a dead consumer idle this long are taken over",
        flag="--claim-min-idle-ms",
        env="BA_CLAIM_MIN_IDLE_MS",
        metavar="MS",
    )
    max_deliveries: int = MAX_DELIVERIES_SETTING
    max_entry_bytes: int = setting(
        DEFAULT_MAX_ENTRY_BYTES,
        ge=1024,
        help="larger inbound entries (all field names and values) are dead-lettered"
        " oversize unread, bytes",
        flag="--max-entry-bytes",
        env="BA_MAX_ENTRY_BYTES",
        metavar="BYTES",
    )
    max_entry_fields: int = MAX_ENTRY_FIELDS_SETTING
    rate_limit: float | None = setting(
        None,
        gt=0,
        help="entries per second per principal; over it they are dead-lettered rate_limited",
        flag="--rate-limit",
        env="BA_RATE_LIMIT",
        metavar="N",
        shown="off",
    )
    rate_burst: int | None = setting(
        None,
        ge=1,
        help="the rate limit's bucket size",
        flag="--rate-burst",
        env="BA_RATE_BURST",
        metavar="N",
        shown="one second's worth",
    )
    max_open_tasks: int | None = setting(
        None,
        ge=1,
        help="a principal with this many pending or running tasks gets no new one (quota_exceeded)",
        flag="--max-open-tasks",
        env="BA_MAX_OPEN_TASKS",
        metavar="N",
        shown="off",
    )

    @field_validator("acl_principals")
    @classmethod
    def _principals(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(v)) != len(v):
            raise ValueError("acl_principals lists a principal twice")
        return v

    @model_validator(mode="after")
    def _mode(self) -> Self:
        if self.mode == "acl" and not self.acl_principals:
            raise ValueError("ACL mode needs acl_principals (whose streams to read)")
        if self.mode == "signed" and self.acl_principals:
            raise ValueError("acl_principals is for ACL mode only")
        if self.mode == "acl" and self.partitions != 1:
            raise ValueError("partitions is for signed mode (ACL mode reads one stream each)")
        return self


class IngestConfig(IngestSettings):
    """How an ``Ingestor`` reads: its section of the settings tree (``IngestSettings``,
    whose attributes it has) and what one ingest needs besides.

    Attributes:
        prefix: key prefix (see ``keys``).
        consumer: this process slot's consumer name, stable across restarts (e.g.
            ``ingest-<host>-<slot>``), so a restarted process replays its own pending list.
        count: entries per read; one accept transaction and one XACK per batch.
        block_ms: how long a read of new entries blocks (split across streams in ACL mode).
        claim_every_s: how often ``run`` looks for entries to take over.
        retention_s: the retention window, seconds: dead letters older than this are
            trimmed from the dead-letter streams.
        trim_every_s: how often ``run`` trims the inbound and dead-letter streams.
        trim_keep_s: acknowledged inbound entries younger than this (or than
            ``retention_s``, if shorter) are kept, seconds.
    """

    prefix: KeyPrefix = PREFIX_SETTING
    consumer: str
    count: int = COUNT_SETTING
    block_ms: int = BLOCK_MS_SETTING
    claim_every_s: float = Field(default=DEFAULT_CLAIM_EVERY_S, gt=0)
    retention_s: float = RETENTION_SETTING
    trim_every_s: float = Field(default=DEFAULT_TRIM_EVERY_S, gt=0)
    trim_keep_s: float = Field(default=DEFAULT_TRIM_KEEP_S, ge=0)

    @field_validator("consumer")
    @classmethod
    def _consumer(cls, v: str) -> str:
        if not 1 <= len(v) <= 128 or not set(v) <= _CONSUMER_CHARS:
            raise ValueError("consumer must be 1..128 characters of letters, digits, '._:-'")
        return v


#: Authenticated entries the inbox took; the ``outcome`` label is ``store.inbox.Outcome``.
INBOX_ENTRIES = Family("ba_inbox_entries", "Authenticated entries the inbox took, by outcome.")


@dataclass
class IngestStats:
    """Counters since start. ``dead_lettered`` is by reason, including the reader's own
    (``payload_deleted``, ``delivery_limit``). The exported ones declare their metric
    (``metric_fields``)."""

    batches: int = 0
    entries: int = 0
    accepted: int = INBOX_ENTRIES.field(outcome="stored")
    duplicates: int = INBOX_ENTRIES.field(outcome="duplicate")
    conflicts: int = INBOX_ENTRIES.field(outcome="conflict")
    expired: int = INBOX_ENTRIES.field(outcome="expired")
    hop_limited: int = INBOX_ENTRIES.field(outcome="hop_limit")
    acked: int = 0
    taken_over: int = 0
    transient_errors: int = 0
    trimmed: int = STREAM_ENTRIES_TRIMMED.field()
    dead_letters_trimmed: int = DEAD_LETTERS_TRIMMED.field()
    trim_failures: int = TRIM_FAILURES.field()
    #: trims that found a group past an id ahead of the server clock (a poisoned stream)
    future_ids: int = STREAM_FUTURE_IDS.field()
    dead_lettered: dict[str, int] = field(default_factory=dict)
