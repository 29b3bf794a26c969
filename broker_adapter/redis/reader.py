"""The consumer-group reader that ingest and the receiver share (``GroupReader``).

Delivery discipline:

* The group is created from ``0`` with MKSTREAM (never ``$``, which would skip entries
  published before the group existed); BUSYGROUP means it exists, which is fine.
* On start and after EVERY error, the reader first re-reads its own pending entries
  (``XREADGROUP ... 0``) until none are left, then switches to new ones (``>``) with BLOCK
  and COUNT. An XREADGROUP whose reply was lost left its entries in this consumer's pending
  list; this is what recovers them.
* A missing group (Redis lost its data) is recreated from ``0``, logged as an alarm, and
  reading carries on.
* Reading ahead is allowed only into this consumer's own pending list: a peeking ``ack``
  reads the next batch in its round trip, and after a whole batch ``prefetch`` sends the
  next read at once, so that Redis prepares it while the batch is checked and committed.
  What was read ahead and not yet handled is dropped on any error and comes back with the
  replay.
* ``take_over`` runs XAUTOCLAIM with a carried cursor until it comes back to ``0-0``, so
  every idle entry of a dead consumer is eventually examined, not just the first page.
* Reads are screened inside Redis (``screening``): an entry over ``max_entry_fields``
  fields or ``max_entry_bytes`` bytes is dead-lettered there and never fetched; a read
  returns at most ``max_batch_bytes``. Entries come as Redis keeps them, name/value pairs
  (``internals``). The reader refuses, before anyone parses them: deleted or trimmed
  entries, entries delivered more than ``max_deliveries`` times, too many fields or bytes
  (a plain read's), and a repeated field name (``duplicate_field``). Each is moved to the
  dead-letter stream with its reason and acknowledged (``dead_lettering``).
* A stream with a submit list (inbound streams: agents RPUSH there, they never XADD) has
  each read of new entries move the list's items into the stream first, inside the same
  function call (``screening``: XADD with ``*``, the server picks every id; malformed and
  oversize items are dead-lettered instead). An idle reader waits on the list
  (``BLMOVE``, which leaves the item in place) for at most ``block_ms``, then reads again,
  so entries added to the stream directly are read too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from pydantic import Field

from broker_adapter.config import DEFAULT_CLAIM_MIN_IDLE_MS, ConfigModel, setting
from broker_adapter.errors import BrokerAdapterError, GroupMissingError, RedisUnavailable
from broker_adapter.protocol.deadletter import UNTRUSTED_COPY_BYTES
from broker_adapter.redis import cluster
from broker_adapter.redis.admission import Admitted
from broker_adapter.redis.client import text, translated
from broker_adapter.redis.dead_lettering import DeadLetterWriter
from broker_adapter.redis.entry import StreamEntry
from broker_adapter.redis.internals import discard, exchange, read_ahead, send_ahead
from broker_adapter.redis.screening import Screened, ScreenedReads, ScreenLimits

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

log = logging.getLogger("broker_adapter.redis.reader")

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


@dataclass
class ReaderStats:
    read: int = 0
    replayed: int = 0
    taken_over: int = 0
    acked: int = 0
    dead_lettered: int = 0
    deleted: int = 0
    group_recreated: int = 0
    reconnects: int = 0
    #: Entries acknowledged without any dead letter because even a minimal one failed.
    dead_letter_failures: int = 0
    #: Dead letters trimmed because their stream was at its cap.
    dead_letters_capped: int = 0
    #: Items moved from the submit list into the stream.
    admitted: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)


class GroupReader:
    """Reads one stream as one consumer of one group, at least once.

    Args:
        client: a client from ``connect`` (no automatic re-sends).
        stream: the stream key.
        group: the consumer group.
        consumer: this reader's stable name (one per process slot, reused across restarts).
        dead_stream: where poison and deleted entries go (same hash tag as ``stream``).
        config: batch sizes and limits.
        logger: where alarms go.
        submit: the stream's submit list (same hash tag), moved into the stream by every
            read of new entries and waited on when idle; None: the stream has none.
    """

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        group: str,
        consumer: str,
        dead_stream: str,
        config: ReaderConfig | None = None,
        logger: logging.Logger | None = None,
        *,
        submit: str | None = None,
    ) -> None:
        self.client = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.dead_stream = dead_stream
        self.config = config or ReaderConfig()
        self.log = logger or log
        self.stats = ReaderStats()
        self._replaying = True
        self._cursor = "0-0"
        self._group_ready = False
        #: Entries read by the last peeking ``ack``: what the next ``read`` returns.
        self._ahead: list[StreamEntry] = []
        #: A connection taken from the pool with a ``prefetch`` read sent on it and its
        #: reply not yet read (the next ``ack`` or ``read`` reads it).
        self._inflight: Any = None
        #: The last read of new entries filled a whole batch (more are likely waiting).
        self._full = False
        self.dead_letters = DeadLetterWriter(
            client, stream, group, consumer, dead_stream, self.config, self.stats, self.log
        )
        cfg = self.config
        limits = ScreenLimits(
            count=cfg.count,
            max_fields=cfg.max_entry_fields,
            max_bytes=cfg.max_entry_bytes,
            budget=cfg.max_batch_bytes,
            copy_bytes=min(cfg.max_entry_bytes, UNTRUSTED_COPY_BYTES),  # refused unread
            max_deliveries=cfg.max_deliveries,
        )
        self.reads = ScreenedReads(
            client, stream, dead_stream, group, consumer, limits, self.log, submit
        )
        #: The last admission error logged (one alarm per error, not one per read).
        self._admit_error = ""

    # -- group ----------------------------------------------------------------------------

    def ensure_group(self) -> None:
        """Create the group from ``0`` (MKSTREAM); an existing group is left as it is."""
        try:
            with translated():
                self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except BrokerAdapterError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def _recreate_group(self) -> None:
        self.log.error(
            "ALARM: consumer group %s on %s is gone (Redis lost its data?); recreating from 0",
            self.group,
            self.stream,
        )
        self.stats.group_recreated += 1
        self._drop_inflight()  # a read of the group that is gone
        self.ensure_group()
        self._replaying = True
        self._cursor = "0-0"

    def reset(self) -> None:
        """Call after any error: the next read starts again with this consumer's own pending
        (entries read ahead are dropped: they are in that list)."""
        self._ahead = []
        self._drop_inflight()
        self._replaying = True
        self.stats.reconnects += 1

    def replay(self) -> None:
        """From the next read of Redis on, re-read this consumer's own pending list before
        new entries (what ``reset`` does after an error; entries read ahead are kept)."""
        self._replaying = True

    def defer_replay(self) -> None:
        """Read new entries only and leave this consumer's own pending list alone until
        ``replay`` (or an error's ``reset``): e.g. entries whose handling just failed wait
        for a pause instead of coming back at the very next read."""
        self._replaying = False

    # -- reading --------------------------------------------------------------------------

    def read(self, *, block: bool = True) -> list[StreamEntry]:
        """The next batch: own pending entries first (after start or an error), then new ones.

        Poison and deleted entries are dead-lettered here and not returned.

        Args:
            block: wait up to ``block_ms`` for new entries; ``False`` returns at once (a
                caller reading several streams in turn blocks only when all were empty).

        Raises:
            RedisUnavailable: the read failed; call again (it will replay pending first).
        """
        if self._ahead:
            ahead, self._ahead = self._ahead, []
            return ahead  # screened when they were read
        if self._inflight is not None:
            return self._finish_prefetch(None)[0]
        if not self._group_ready:
            self.ensure_group()
        try:
            batch = self._read_once(block)
        except GroupMissingError:
            self._recreate_group()
            return []
        except RedisUnavailable:
            self.reset()
            raise
        return self._screen(batch)

    def _read_once(self, block: bool = True) -> list[StreamEntry]:
        if self._replaying:
            done = self._screened(self.reads.read("0"))
            entries = done.entries
            if not entries and not done.refused and not done.left:
                self._replaying = False
                return []
            self.stats.replayed += len(entries)
            return self._with_deliveries(entries) if entries else []
        done = self._screened(self.reads.read(">"))
        admitted = done.admitted
        more = admitted is not None and admitted.more and not admitted.error
        if not done.entries and not done.refused and not done.left and block and not more:
            reads = self.reads
            stuck = admitted is not None and bool(admitted.error)  # nothing to wait on
            if (
                reads.submit is not None
                and reads.admitting
                and reads.waiting_on_submit
                and not stuck
            ):
                # Wait for an item to be published (it stays in the list), then move it.
                reads.wait(self.config.block_ms)
                if reads.waiting_on_submit:
                    return self._counted(self._screened(reads.read(">")))
            # Nothing new: wait for an entry. A function cannot block, so this read is a
            # plain one, of ONE entry (measured by ``_screen`` once it is here).
            done = reads.read(">", block_ms=self.config.block_ms)
        return self._counted(done)

    def _screened(self, done: Screened) -> Screened:
        """Count and log what a screened read dead-lettered inside Redis; after a read that
        left an entry pending (its budget spent), replay the pending list next."""
        for entry_id, reason in done.refused:
            self.stats.dead_lettered += 1
            self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + 1
            self.log.warning(
                "dead-lettered %s from %s: %s (screened in Redis)", entry_id, self.stream, reason
            )
        if done.left:
            self._replaying = True
        if done.admitted is not None:
            self._admission(done.admitted)
        return done

    def _admission(self, admitted: Admitted) -> None:
        """Count and log what a read moved from the submit list (or refused there)."""
        self.stats.admitted += admitted.count
        for reason in admitted.refused:
            dropped = reason.startswith("dropped:")
            reason = reason.removeprefix("dropped:")
            self.stats.dead_lettered += 1
            self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + 1
            if dropped:
                self.stats.dead_letter_failures += 1
                self.log.error(
                    "ALARM: an item of %s was refused (%s) and no dead letter could be "
                    "written to %s: it is gone",
                    self.reads.submit,
                    reason,
                    self.dead_stream,
                )
            else:
                self.log.warning(
                    "dead-lettered an item of %s: %s (screened in Redis)", self.reads.submit, reason
                )
        if admitted.error and admitted.error != self._admit_error:
            self.log.error(
                "ALARM: cannot add entries of %s to %s (%s): they wait in the list "
                '(docs/OPERATIONS.md, "A stream with ids in the future")',
                self.reads.submit,
                self.stream,
                admitted.error,
            )
        self._admit_error = admitted.error

    def _counted(self, done: Screened) -> list[StreamEntry]:
        """The entries of a read of new ones (``_full`` notes whether more are waiting)."""
        self.stats.read += len(done.entries)
        self._full = (
            done.left
            or len(done.entries) + len(done.refused) >= self.config.count
            or (done.admitted is not None and done.admitted.more and not done.admitted.error)
        )
        return done.entries

    # -- reading ahead ----------------------------------------------------------------------

    def prefetch(self) -> bool:
        """When the last read of new entries filled a whole batch, send the read of the next
        batch now (without blocking) and return at once: Redis prepares it while the caller
        checks and commits this one. The next ``ack`` (or ``read``) takes its reply, in the
        round trip of its XACK. The entries it delivers are in this consumer's pending list
        from then on, so any error before they are handled is recovered like any other:
        ``reset``, then the replay of the pending list.

        Returns:
            whether a read was sent.

        Raises:
            RedisUnavailable: the send failed (the reader is reset).
        """
        if not self._full or self._replaying or self._ahead or self._inflight is not None:
            return False
        if cluster.is_cluster(self.client):  # a held connection would not follow a moved slot
            return False
        if not self.reads.screening:  # only a read known to work is sent ahead
            return False
        self._full = False
        try:
            with translated():
                conn = send_ahead(self.client, self.reads.read_command(">"))
        except BaseException:
            self.reset()
            raise
        self._inflight = conn
        return True

    def _finish_prefetch(self, entry_ids: Sequence[str] | None) -> tuple[list[StreamEntry], int]:
        """Take the prefetched read's reply, after sending the XACK of ``entry_ids`` on the same
        connection (one round trip for both). Returns the screened entries and the XACK count
        (a missing group is recreated, and nothing is returned).

        Raises:
            RedisUnavailable: the reader is reset (both commands may or may not have run).
        """
        conn, self._inflight = self._inflight, None
        xack = ("XACK", self.stream, self.group, *entry_ids) if entry_ids else None
        try:
            with translated():
                reply, acked_reply = read_ahead(self.client, conn, xack)  # reply: raw pairs
        except GroupMissingError:
            self._recreate_group()
            return [], 0
        except BrokerAdapterError as exc:
            self.reset()
            self.reads.note_failure(exc)
            if self.reads.screening is None:
                return [], 0  # the function went away (a new server): the next read loads it
            raise
        except BaseException:
            self.reset()
            raise
        acked = int(acked_reply) if entry_ids else 0
        self.stats.acked += acked
        return self._new_entries(reply), acked

    def _drop_inflight(self) -> None:
        conn, self._inflight = self._inflight, None
        if conn is not None:
            discard(self.client.connection_pool, conn)

    def _new_entries(self, reply: Any) -> list[StreamEntry]:
        """The screened entries of a non-blocking read of new ones (``read_command(">")``),
        read ahead for the next ``read`` (``_full`` notes whether it filled a batch)."""
        done = self._screened(self.reads.parse_read(self.reads.read_command(">"), reply))
        return self._screen(self._counted(done))

    def _with_deliveries(self, entries: list[StreamEntry]) -> list[StreamEntry]:
        """Attach delivery counts (from XPENDING) to entries that came from a pending list."""
        ids = [e.entry_id for e in entries]
        with translated():
            rows = self.client.xpending_range(
                self.stream,
                self.group,
                min=min(ids, key=_id_key),
                max=max(ids, key=_id_key),
                count=len(ids) * 2 + 10,
                consumername=self.consumer,
            )
        counts = {text(r["message_id"]): int(r["times_delivered"]) for r in rows}  # type: ignore[arg-type]
        return [e._replace(deliveries=counts.get(e.entry_id, 1)) for e in entries]

    def _screen(self, batch: list[StreamEntry]) -> list[StreamEntry]:
        """The entries of ``batch`` fit to be parsed; the others are dead-lettered here."""
        good: list[StreamEntry] = []
        for entry in batch:
            try:
                refusal = self._refusal(entry)
            except Exception as exc:  # noqa: BLE001 - one entry's problem, not the batch's
                self.dead_letter_exception(entry, exc, "screening it")
                continue
            if refusal is None:
                good.append(entry)
            else:
                self.dead_letter(entry, *refusal)
        return good

    def _refusal(self, entry: StreamEntry) -> tuple[str, str, dict[str, str]] | None:
        """Why ``entry`` must not be handed on, as ``(reason, detail, extra)``, or None.

        In this order: deleted, past the delivery limit, too many fields, too large, a
        repeated field name. The checks look at counts and lengths only (the per-entry cost
        on the hot path is a few list lengths)."""
        cfg = self.config
        fields = entry.fields
        if fields is None:
            self.stats.deleted += 1
            return "payload_deleted", "entry was deleted or trimmed", {}
        if entry.deliveries > cfg.max_deliveries:
            detail = f"delivered {entry.deliveries} times, limit {cfg.max_deliveries}"
            return "delivery_limit", detail, {}
        pairs = entry.flat()
        if len(pairs) > 2 * cfg.max_entry_fields:
            detail = f"entry has {len(pairs) // 2} fields, limit {cfg.max_entry_fields}"
            return "too_many_fields", detail, {"dl.field": ""}
        size = sum(map(len, pairs))
        if size > cfg.max_entry_bytes:
            detail = f"entry is {size} bytes, limit {cfg.max_entry_bytes}"
            return "oversize", detail, {"dl.field": ""}
        if 2 * len(fields) != len(pairs):
            name = text(_repeated_name(pairs))
            detail = f"field {name!r} appears more than once"
            return "duplicate_field", detail, {"dl.field": name}
        return None

    def take_over(self) -> list[StreamEntry]:
        """XAUTOCLAIM one page of entries idle past ``claim_min_idle_ms`` (from any consumer).

        The cursor is carried between calls and restarts from ``0-0`` only when Redis says
        the scan is complete. Deleted entries are dead-lettered; the rest are returned.
        """
        if not self._group_ready:
            self.ensure_group()
        try:
            done = self._screened(self.reads.claim(self._cursor, self.config.claim_min_idle_ms))
        except GroupMissingError:
            self._recreate_group()
            return []
        except RedisUnavailable:
            self.reset()
            raise
        self._cursor = done.cursor
        for entry_id in done.deleted:
            # XAUTOCLAIM already removed deleted ids from the pending list: record them.
            self.stats.deleted += 1
            self.dead_letters.write_fields(
                entry_id, "payload_deleted", "entry was deleted or trimmed", 0, ack=False
            )
        entries = done.entries
        if not entries:
            return []
        self.stats.taken_over += len(entries)
        return self._screen(self._with_deliveries(entries))

    @property
    def scan_complete(self) -> bool:
        """True when the last ``take_over`` reached the end of the pending list."""
        return self._cursor == "0-0"

    # -- acknowledging --------------------------------------------------------------------

    def ack(self, entry_ids: Sequence[str], *, peek: bool = False) -> int:
        """XACK a batch (one command). A count below ``len(entry_ids)`` is not an error: an
        entry acknowledged before (a lost XACK reply, a replay) counts 0.

        Args:
            entry_ids: the entries to acknowledge.
            peek: in the same round trip, read the next new entries without blocking (one
                round trip, and on an ``appendfsync always`` server one fsync, where an
                ``ack`` and a ``read`` take two); the next ``read`` returns them. Ignored
                while this reader still replays its own pending list. After a
                ``prefetch`` the read was sent already: the XACK goes on its connection and
                its reply is taken, peek or not.

        Raises:
            RedisUnavailable: the call failed; with ``peek`` (or a prefetch) both commands
                may or may not have run (the reader is reset: the next ``read`` replays its
                pending list).
        """
        if not entry_ids:
            return 0
        if self._inflight is not None:
            self._ahead, n = self._finish_prefetch(entry_ids)
            return n
        xack = ("XACK", self.stream, self.group, *entry_ids)
        if not peek or self._replaying:
            try:
                with translated():
                    (acked,) = exchange(self.client, [xack], raw=True)
            except GroupMissingError:
                self._recreate_group()  # the entries come back from 0 (duplicates then)
                return 0
            n = int(acked)
            self.stats.acked += n
            return n
        if not self.reads.screening or cluster.is_cluster(self.client):
            return self.ack(entry_ids)  # only a read known to work (a slot may migrate)
        try:
            with translated():
                acked, reply = exchange(self.client, [xack, self.reads.read_command(">")], raw=True)
        except GroupMissingError:
            self._recreate_group()
            return 0
        except BrokerAdapterError as exc:
            self.reset()
            self.reads.note_failure(exc)
            if self.reads.screening is None:
                return 0  # the function went away: the replay acknowledges them again
            raise
        except BaseException:
            self.reset()
            raise
        n = int(acked)
        self.stats.acked += n
        self._ahead = self._new_entries(reply)
        return n

    @property
    def has_ahead(self) -> bool:
        """Whether entries read ahead (by a peeking ``ack`` or a ``prefetch``) wait for the
        next ``read``."""
        return bool(self._ahead) or self._inflight is not None

    # -- dead letters (``dead_lettering``) ------------------------------------------------

    def dead_letter(
        self,
        entry: StreamEntry,
        reason: str,
        detail: str,
        extra: Mapping[str, str] | None = None,
    ) -> str | None:
        """Move ``entry`` to the dead-letter stream with its reason, and XACK it, atomically
        (``DeadLetterWriter.write``: it never fails because of what the entry holds)."""
        return self.dead_letters.write(entry, reason, detail, extra)

    def dead_letter_exception(self, entry: StreamEntry, exc: Exception, doing: str) -> None:
        """Dead-letter ``entry`` as ``internal_error``: handling it raised ``exc``
        (``DeadLetterWriter.write_exception``)."""
        self.dead_letters.write_exception(entry, exc, doing)

    def dead_letter_many(
        self, refused: Sequence[tuple[StreamEntry, str, str, Mapping[str, str]]]
    ) -> int:
        """``dead_letter`` for many entries in one round trip
        (``DeadLetterWriter.write_many``)."""
        return self.dead_letters.write_many(refused)

    # -- inspection -----------------------------------------------------------------------

    def pending(self) -> dict[str, int]:
        """Pending entries per consumer of this group."""
        with translated():
            info = self.client.xpending(self.stream, self.group)
        return {text(c["name"]): int(c["pending"]) for c in info.get("consumers") or []}


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _repeated_name(pairs: Sequence[bytes]) -> bytes:
    """The first field name that ``pairs`` repeats (``b""`` if none does)."""
    seen: set[bytes] = set()
    for name in pairs[::2]:
        if name in seen:
            return name
        seen.add(name)
    return b""
