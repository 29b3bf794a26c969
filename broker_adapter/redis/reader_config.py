"""How a group reader reads: its limits, the settings the ingest and the receiver declare
them with, and the counters it keeps (``ReaderConfig``, ``ReaderStats``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from broker_adapter.config import DEFAULT_CLAIM_MIN_IDLE_MS, ConfigModel, setting
from broker_adapter.metric_fields import REDIS_DATA_LOSS_ALARMS, Family

#: The most entries one read may ask for (``count``), and how many by default.
MAX_COUNT = 10_000
DEFAULT_COUNT = 256
#: How long a read of new entries blocks by default, milliseconds.
DEFAULT_BLOCK_MS = 1000
#: Entries delivered more often than this go to the dead-letter stream (by default).
DEFAULT_MAX_DELIVERIES = 10
#: Entries with more fields than this are dead-lettered as ``too_many_fields``.
DEFAULT_MAX_ENTRY_FIELDS = 64
#: The range ``max_entry_fields`` may take: an entry needs a few fields, and the
#: dead-letter script's argument list (two per copied field) must stay far below the
#: 7,998 values Lua can unpack.
MIN_ENTRY_FIELDS, MAX_ENTRY_FIELDS = 8, 1000
#: A bare ``ReaderConfig``'s entry size limit (the ingest and the receiver set their own:
#: ``ingest_config.DEFAULT_MAX_ENTRY_BYTES``, ``receiver.DEFAULT_MAX_REPLY_BYTES``).
READER_MAX_ENTRY_BYTES = 1024 * 1024
#: The most bytes of entries one read returns by default (``max_batch_bytes``).
DEFAULT_MAX_BATCH_BYTES = 8 * 1024 * 1024

#: The reading settings that the ingest and the receiver hold too, declared once.
COUNT_SETTING = setting(
    DEFAULT_COUNT, ge=1, le=MAX_COUNT, help="entries per read (and per transaction)"
)
BLOCK_MS_SETTING = setting(
    DEFAULT_BLOCK_MS,
    ge=1,
    help="how long a read of new entries blocks, ms (Redis reads BLOCK 0 as for ever)",
)
#: 0 takes an idle entry over at once (the ingest, and so ``run``, refuses it:
#: ``ingest_config.CLAIM_MIN_IDLE_SETTING``).
IDLE_MS_SETTING = setting(
    DEFAULT_CLAIM_MIN_IDLE_MS,
    ge=0,
    help="entries idle this long in another consumer's list are taken over, ms",
)
MAX_DELIVERIES_SETTING = setting(
    DEFAULT_MAX_DELIVERIES,
    ge=1,
    help="entries delivered more often go to the dead-letter stream",
    flag="--max-deliveries",
    env="BA_MAX_DELIVERIES",
    metavar="N",
)
MAX_ENTRY_FIELDS_SETTING = setting(
    DEFAULT_MAX_ENTRY_FIELDS,
    ge=MIN_ENTRY_FIELDS,
    le=MAX_ENTRY_FIELDS,
    help="entries of more fields are dead-lettered too_many_fields unread; also the"
    " most fields a dead letter copies",
    flag="--max-entry-fields",
    env="BA_MAX_ENTRY_FIELDS",
    metavar="N",
)


class ReaderConfig(ConfigModel):
    """How a ``GroupReader`` reads.

    Attributes:
        count: entries per read (1..10,000).
        block_ms: how long a read of new entries blocks (at least 1: Redis reads ``BLOCK
            0`` as "for ever").
        claim_min_idle_ms: entries idle this long in another consumer's list are taken over.
        max_deliveries: entries delivered more often than this go to the dead-letter stream.
        max_entry_fields: entries of more fields (repeated names counted) are dead-lettered
            as ``too_many_fields``; also the most fields a dead letter copies
            (``MIN_ENTRY_FIELDS..MAX_ENTRY_FIELDS``).
        max_entry_bytes: entries larger than this (all field names and values) are
            dead-lettered as ``oversize`` before anyone parses them; also the most bytes
            a dead letter copies. Reads are screened inside Redis (``screening``): a
            larger entry never reaches this process, it is dead-lettered on the server.
        max_batch_bytes: the most bytes of entries one read returns (the first always is).

    Raises:
        ConfigError: a value outside its bounds.
    """

    count: int = COUNT_SETTING
    block_ms: int = BLOCK_MS_SETTING
    claim_min_idle_ms: int = IDLE_MS_SETTING
    max_deliveries: int = MAX_DELIVERIES_SETTING
    max_entry_fields: int = MAX_ENTRY_FIELDS_SETTING
    max_entry_bytes: int = Field(default=READER_MAX_ENTRY_BYTES, ge=1)
    max_batch_bytes: int = Field(default=DEFAULT_MAX_BATCH_BYTES, ge=1)


# -- the counters ---------------------------------------------------------------------------

STREAM_ENTRIES_READ = Family(
    "ba_stream_entries_read", "New stream entries read (XREADGROUP >).", True
)
STREAM_ENTRIES_REPLAYED = Family(
    "ba_stream_entries_replayed",
    "Entries re-read from the consumer's own pending list (after a start or an error).",
    per_stage=True,
)
STREAM_ENTRIES_TAKEN_OVER = Family(
    "ba_stream_entries_taken_over", "Entries claimed from idle consumers (XAUTOCLAIM).", True
)
STREAM_ENTRIES_ACKED = Family(
    "ba_stream_entries_acked", "Entries acknowledged (XACK).", per_stage=True
)
STREAM_DEAD_LETTERS = Family(
    "ba_stream_dead_letters", "Entries moved to a dead-letter stream, by reason.", True
)
STREAM_DEAD_LETTER_FAILURES = Family(
    "ba_stream_dead_letter_failures",
    "Entries acknowledged without a dead letter because even a minimal one failed.",
    per_stage=True,
)
DEAD_LETTERS_CAPPED = Family(
    "ba_dead_letters_capped", "Dead letters trimmed because their stream was at its cap.", True
)
REDIS_RECONNECTS = Family(
    "ba_redis_reconnects", "Reads started over after a Redis or store error.", True
)


@dataclass
class ReaderStats:
    """A reader's counters since start. The exported ones declare their metric
    (``metric_fields``); the exporter labels them with the reader's stage."""

    read: int = STREAM_ENTRIES_READ.field()
    replayed: int = STREAM_ENTRIES_REPLAYED.field()
    taken_over: int = STREAM_ENTRIES_TAKEN_OVER.field()
    acked: int = STREAM_ENTRIES_ACKED.field()
    dead_lettered: int = 0
    deleted: int = 0
    group_recreated: int = REDIS_DATA_LOSS_ALARMS.field(kind="group_lost")
    reconnects: int = REDIS_RECONNECTS.field()
    #: Entries acknowledged without any dead letter because even a minimal one failed.
    dead_letter_failures: int = STREAM_DEAD_LETTER_FAILURES.field()
    #: Dead letters trimmed because their stream was at its cap.
    dead_letters_capped: int = DEAD_LETTERS_CAPPED.field()
    #: Items moved from the submit list into the stream.
    admitted: int = 0
    #: Dead letters by reason (a ``dataclasses.field``: a new dict per instance).
    by_reason: dict[str, int] = STREAM_DEAD_LETTERS.field_by("reason")  # noqa: RUF009
