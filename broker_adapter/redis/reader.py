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
  replay (``reading_ahead``).
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
from typing import Any

import redis

from broker_adapter.errors import BrokerAdapterError, GroupMissingError, RedisUnavailable
from broker_adapter.protocol.deadletter import UNTRUSTED_COPY_BYTES
from broker_adapter.redis.admission import Admitted
from broker_adapter.redis.client import text, translated
from broker_adapter.redis.dead_lettering import DeadLetterWriter
from broker_adapter.redis.entry import StreamEntry
from broker_adapter.redis.entry_checks import (
    count_admitted,
    count_screened,
    entry_refusal,
    with_deliveries,
)
from broker_adapter.redis.internals import exchange
from broker_adapter.redis.reader_config import ReaderConfig, ReaderStats
from broker_adapter.redis.reading_ahead import ReadingAhead
from broker_adapter.redis.screening import Screened, ScreenedReads, ScreenLimits

log = logging.getLogger("broker_adapter.redis.reader")


class GroupReader(ReadingAhead):
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
        count_screened(done.refused, self.stats, self.log, self.stream)
        if done.left:
            self._replaying = True
        if done.admitted is not None:
            self._admission(done.admitted)
        return done

    def _admission(self, admitted: Admitted) -> None:
        """Count and log what a read moved from the submit list (or refused there)."""
        self._admit_error = count_admitted(
            admitted,
            self.stats,
            self.log,
            stream=self.stream,
            submit=self.reads.submit,
            dead_stream=self.dead_stream,
            last_error=self._admit_error,
        )

    def _counted(self, done: Screened) -> list[StreamEntry]:
        """The entries of a read of new ones (``_full`` notes whether more are waiting)."""
        self.stats.read += len(done.entries)
        self._full = (
            done.left
            or len(done.entries) + len(done.refused) >= self.config.count
            or (done.admitted is not None and done.admitted.more and not done.admitted.error)
        )
        return done.entries

    def _with_deliveries(self, entries: list[StreamEntry]) -> list[StreamEntry]:
        """Attach delivery counts (from XPENDING) to entries that came from a pending list."""
        return with_deliveries(self.client, self.stream, self.group, self.consumer, entries)

    def _screen(self, batch: list[StreamEntry]) -> list[StreamEntry]:
        """The entries of ``batch`` fit to be parsed; the others are dead-lettered here."""
        good: list[StreamEntry] = []
        for entry in batch:
            try:
                why = entry_refusal(entry, self.config, self.stats)
            except Exception as exc:  # noqa: BLE001 - one entry's problem, not the batch's
                self.dead_letter_exception(entry, exc, "screening it")
                continue
            if why is None:
                good.append(entry)
            else:
                self.dead_letter(entry, *why)
        return good

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
        return self._ack_and_read(xack, entry_ids)

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
