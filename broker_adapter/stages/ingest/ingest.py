"""Ingest: inbound stream entries into the SQLite inbox, at least once in, exactly once stored.

Invariants kept:

* Rule 2: every stored request carries a principal from a trusted check (a verified HMAC,
  or the stream a Redis ACL binds to one principal); the entry screening that enforces it,
  and dead-letters each entry that fails on its own, is ``intake``.
* Rule 5: XACK comes only after the inbox rows and task rows of the whole batch committed
  together in ONE ``TaskStore.accept`` transaction. The ACK means "durably in the inbox",
  never "done".
* Bad input of every shape (too many fields, a repeated field name, oversize, not UTF-8,
  not JSON, not an envelope, unsigned, spoofed, not a task) is moved to the dead-letter
  stream with its reason and the original fields, and acknowledged in one atomic script:
  rejected, nothing written, nothing lost. The shape of the entry (fields, size) is checked
  by the ``GroupReader`` before anything is parsed. Only transient failures of Redis or
  SQLite (not an entry's fault) fail the batch, which is then replayed.

Settings and counters: ``ingest_config``. Each stream's batches go through a
``consumer.GroupConsumer`` (the read, the hold across a busy store, commit before XACK);
this module gives it the screening (``intake``), the accept transaction and what follows it.

How one batch goes (``step``)::

    read (own pending first; the reader dead-letters deleted, over-delivered, too many
          fields, oversize, repeated names) -> hit ingest.after_read
    authenticate, validate; dead-letter the bad ones
    ingress limits of the authenticated principal (``limits``); the refused ones
      dead-lettered together, in one round trip -> ingest.after_dead_letter
    TaskStore.accept(batch)   -> one transaction (store.accept.before/after_commit)
                              -> hit ingest.after_commit
    dead-letter NOT_TASK and REFUSED outcomes (a ``cancel`` envelope is applied instead:
    ``cancels``)
    ONE XACK for the batch    -> hit ingest.after_xack

Trimming (``trim``, every ``trim_every_s`` from ``tick``; ``trimming``). Each inbound stream
is cut with ``XTRIM MINID`` up to the oldest entry that ANY consumer group on it, not only
``ba-ingest``, has not been delivered yet or still has pending (a dead consumer's pending
entries hold the bound until they are taken over and acknowledged); a stream with no group
is not trimmed, and an inbound entry is never trimmed for its age. Acknowledged entries
younger than ``min(trim_keep_s, retention_s)`` stay too: that is how long the original of a
truncated dead letter can still be read in its stream under ``dl.entry_id``. The
dead-letter stream goes by age: a dead letter older than ``retention_s`` is removed. A trim
is one atomic script per stream; a crash around it (``ingest.after_trim``) loses nothing,
and one the server refuses (an ACL without ``xinfo|groups`` or ``xtrim``) is logged as an
alarm and tried again at the next interval, without stopping the ingest.

Crash safety: a crash anywhere before the XACK leaves the entries pending in this consumer's
list. On restart under the same consumer name the ``GroupReader`` replays them first; under
a new name, ``take_over`` claims them with XAUTOCLAIM once they are idle past
``claim_min_idle_ms``. The replayed copies meet the inbox's unique (principal, message_id)
key and come back ``DUPLICATE`` (same task id), so nothing is stored twice; a crash before
the commit left nothing behind to duplicate. Every failed Redis write is treated as "maybe
executed": XACK and the dead-letter script are idempotent (an acknowledged entry is not
replayed; an unacknowledged one is handled again), and after any error the reader replays
its own pending list before it reads anything new. No Redis call happens inside the SQLite
transaction.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from broker_adapter import crashpoints
from broker_adapter.clock import Clock, SystemClock
from broker_adapter.config import derive
from broker_adapter.errors import ConfigError, EnvelopeError, TransientError
from broker_adapter.metric_fields import fields_by_label
from broker_adapter.protocol import deadletter
from broker_adapter.protocol.keys import INGEST_GROUP, Keys
from broker_adapter.protocol.signing import Authenticated, EntryFields, Keyring
from broker_adapter.redis.entry import StreamEntry
from broker_adapter.redis.reader import GroupReader
from broker_adapter.redis.reader_config import ReaderConfig
from broker_adapter.redis.trimming import now_ms as trim_now_ms
from broker_adapter.redis.trimming import trim_with_dead_letters
from broker_adapter.stages.ingest import intake
from broker_adapter.stages.ingest.cancels import CANCEL_KIND, apply_cancel
from broker_adapter.stages.ingest.config import INBOX_ENTRIES, IngestConfig, IngestStats
from broker_adapter.stages.ingest.limits import IngressLimits
from broker_adapter.stages.shared import tracing
from broker_adapter.stages.shared.consumer import (
    Checked,
    CrashPoints,
    GroupConsumer,
    check_block_timeout,
)
from broker_adapter.stages.shared.loop import run_stage
from broker_adapter.store.inbox import AcceptItem, AcceptResult, Outcome
from broker_adapter.store.tasks import TaskStore

if TYPE_CHECKING:
    from collections.abc import Callable

    from broker_adapter.redis.client import Redis

#: ``take_over`` pages through at most this many XAUTOCLAIM replies per stream per call.
TAKE_OVER_MAX_PAGES = 64

log = logging.getLogger("broker_adapter.stages.ingest")


#: A cancel the database was too busy to apply: its entry stays pending.
_NOT_NOW = EnvelopeError("payload", "busy", "the database was busy")

#: ``Outcome`` -> the ``IngestStats`` field that counts it (their metric's ``outcome`` label).
_OUTCOME_COUNTER = fields_by_label(IngestStats, INBOX_ENTRIES, "outcome")


_POINTS = CrashPoints(
    after_commit="ingest.after_commit",
    after_xack="ingest.after_xack",
    after_read="ingest.after_read",
    after_take_over="ingest.after_autoclaim",
)


@dataclass
class _Source:
    """One inbound stream and, in ACL mode, the principal its ACL binds to it."""

    principal: str | None
    #: ``intake.authenticator`` for this stream.
    authenticate: Callable[[EntryFields], Authenticated]
    #: Reads, holds across a busy store and acknowledges this stream's batches.
    consumer: GroupConsumer[AcceptItem, AcceptResult] = field(init=False)

    @property
    def reader(self) -> GroupReader:
        return self.consumer.reader


class AcceptHandoff(Protocol):
    """Makes the ingest's accept transaction hand its new tasks to idle workers
    (``handoff.Handoff``): the hook the runner gives the ingest, in place of a plain
    ``TaskStore.accept``."""

    def accept(self, tasks: TaskStore, items: Sequence[AcceptItem]) -> list[AcceptResult]: ...


class Ingestor:
    """Moves inbound entries into the inbox: authenticate, store in one transaction, XACK.

    Args:
        config: what to read and how.
        client: a client from ``redis.client.connect`` (no automatic re-sends); its socket
            timeout must exceed ``block_ms``.
        tasks: the inbox / task store.
        keyring: verifies signatures; required in signed mode, ignored in ACL mode.
        clock: decides when ``take_over`` is due (a ``FakeClock`` in tests).
        logger: where warnings and alarms go.
        handoff: makes each batch's accept instead of ``TaskStore.accept``, handing the new
            tasks to idle workers (``AcceptHandoff``; the runner's ``handoff.Handoff``).

    Raises:
        ConfigError: signed mode without a keyring, or a socket timeout not above BLOCK.
    """

    def __init__(
        self,
        config: IngestConfig,
        client: Redis,
        tasks: TaskStore,
        keyring: Keyring | None,
        *,
        clock: Clock | None = None,
        logger: logging.Logger | None = None,
        handoff: AcceptHandoff | None = None,
    ) -> None:
        if config.mode == "signed" and keyring is None:
            raise ConfigError("signed mode needs a keyring to verify signatures")
        self.config = config
        self.client = client
        self.tasks = tasks
        self._handoff = handoff
        self.keyring = keyring
        self.clock = clock or SystemClock()
        self.log = logger or log
        self.keys = Keys(config.prefix)
        self.stats = IngestStats()
        self.limits = IngressLimits(
            self.clock,
            rate_limit=config.rate_limit,
            rate_burst=config.rate_burst,
            max_open_tasks=config.max_open_tasks,
            open_counts=tasks.open_counts,
            stored=tasks.stored_message_ids,
        )
        # (stream, dead-letter stream, principal bound to it): one per ACL principal, or
        # the signed mode's partitions (one: the shared stream).
        streams: Sequence[tuple[str, str, str | None]] = (
            [(self.keys.inbound(p), self.keys.inbound_dead(p), p) for p in config.acl_principals]
            if config.mode == "acl"
            else [
                (s, self.keys.dead_for(s), None)
                for s in self.keys.inbound_partitions(config.partitions)
            ]
        )
        block_ms = max(1, config.block_ms // len(streams))
        check_block_timeout(client, block_ms)
        reader_config = derive(ReaderConfig, config, block_ms=block_ms)
        self._sources: list[_Source] = []
        for stream, dead, p in streams:
            source = _Source(p, intake.authenticator(p, keyring))
            source.consumer = GroupConsumer(
                GroupReader(
                    client,
                    stream,
                    INGEST_GROUP,
                    config.consumer,
                    dead,
                    reader_config,
                    self.log,
                    submit=self.keys.submit_for(stream),
                ),
                _POINTS,
                screen=functools.partial(self._screen, source),
                commit=self._accept,
                settle=functools.partial(self._after_commit, source),
            )
            self._sources.append(source)
        self._next_take_over = float("-inf")
        self._next_trim = self.clock.now() + config.trim_every_s
        #: the last ``step`` handled nothing: the next one may block on its reads
        self._idle_round = True

    @property
    def readers(self) -> list[GroupReader]:
        """One reader per inbound stream (one in signed mode)."""
        return [s.reader for s in self._sources]

    # -- the loop ---------------------------------------------------------------------------

    def step(self, *, peek: bool = True) -> int:
        """Read and ingest one batch per stream (own pending entries first).

        Args:
            peek: read the next new entries in the round trip of this batch's XACK (after a
                whole batch that read is sent before the batch is checked:
                ``GroupReader.prefetch``); they are handled by the next call (``run`` ends
                with a call without it, so that a clean stop leaves nothing read and
                unhandled).

        Returns:
            how many entries were handled (stored, duplicate, conflict or dead-lettered).

        Raises:
            TransientError: Redis or SQLite failed; call again (the reader replays first).
        """
        handled = 0
        # Several streams (partitions, ACL principals) are read in turn; a read blocks only
        # when the previous round found all of them empty, so that traffic on one stream
        # never waits out the blocking reads of the idle others.
        block = self._idle_round or len(self._sources) == 1
        for source in self._sources:
            try:
                handled += source.consumer.step(block=block, peek=peek).handled
            finally:
                self._sync_stats()
        self._idle_round = handled == 0
        return handled

    def take_over(self) -> int:
        """Claim (XAUTOCLAIM) entries idle past ``claim_min_idle_ms`` in any consumer's list,
        typically a dead process's, and ingest them like fresh ones.

        Pages through the pending list with a carried cursor until the scan completes or
        ``TAKE_OVER_MAX_PAGES`` pages were handled.

        Returns:
            how many claimed entries were handled.

        Raises:
            TransientError: Redis or SQLite failed; call again.
        """
        handled = 0
        for source in self._sources:
            consumer = source.consumer
            try:
                for _ in range(TAKE_OVER_MAX_PAGES):
                    entries = consumer.take_over()
                    if entries:
                        self.stats.taken_over += len(entries)
                        consumer.handle(entries)
                        handled += len(entries)
                    if consumer.reader.scan_complete:
                        break
            except BaseException:
                consumer.reader.reset()  # a busy store too: the page is read again
                raise
            finally:
                self._sync_stats()
        self._next_take_over = self.clock.now() + self.config.claim_every_s
        return handled

    def trim(self) -> int:
        """Trim each inbound stream up to the oldest entry a group still needs, and each
        dead-letter stream by age (see the module text).

        Returns:
            how many entries were removed, dead letters included.

        Raises:
            TransientError: Redis could not be reached; call again (each stream's trim is
                atomic and safe to repeat).
        """
        cfg = self.config
        now_ms = trim_now_ms(self.client, self.clock)
        keep_from_ms = now_ms - min(cfg.trim_keep_s, cfg.retention_s) * 1000
        removed = 0
        for source in self._sources:
            reader = source.reader
            done = trim_with_dead_letters(
                self.client,
                reader.stream,
                reader.dead_stream,
                keep_from_ms=keep_from_ms,
                dead_before_ms=now_ms - cfg.retention_s * 1000,
                log=self.log,
            )
            if done is None:
                self.stats.trim_failures += 1
                continue
            trimmed, dead = done
            self.stats.future_ids += bool(trimmed.future_id)
            self.stats.trimmed += trimmed.trimmed
            self.stats.dead_letters_trimmed += dead
            removed += trimmed.trimmed + dead
        self._next_trim = self.clock.now() + cfg.trim_every_s
        crashpoints.hit("ingest.after_trim")
        return removed

    def tick(self) -> int:
        """One iteration of ``run``: ``take_over`` and ``trim`` when due, then ``step``.

        Returns:
            how many entries were handled.
        """
        handled = 0
        now = self.clock.now()
        if now >= self._next_take_over:
            handled += self.take_over()
        if now >= self._next_trim:
            self.trim()
        return handled + self.step()

    def run(self, stop: threading.Event) -> None:
        """Ingest until ``stop`` is set (``loop.run_stage``): ``tick`` after ``tick`` (the
        reads block), backing off (capped, jittered) on transient errors, each counted in
        ``stats.transient_errors``; once stopped, steps without ``peek`` while a reader has
        entries read ahead, so that a clean stop leaves nothing read and unhandled.

        Raises:
            BrokerAdapterError: a non-transient failure (e.g. ``StoreError``, an ACL
                refusal); the loop stops loudly rather than spin.
        """

        def count(_exc: BaseException | None) -> None:
            self.stats.transient_errors += 1

        run_stage(
            stop,
            self.tick,
            log=self.log,
            what="ingest",
            pending=lambda: any(source.reader.has_ahead for source in self._sources),
            drain=lambda: self.step(peek=False),
            on_backoff=count,
        )

    # -- one batch --------------------------------------------------------------------------

    def _screen(self, source: _Source, entries: list[StreamEntry]) -> Checked[AcceptItem]:
        good, items = intake.screen(
            source.reader, entries, source.authenticate, self.limits, principal=source.principal
        )
        if len(good) < len(entries):
            crashpoints.hit("ingest.after_dead_letter")
        self.stats.batches += 1
        self.stats.entries += len(entries)
        return Checked(good, items)

    def _accept(self, items: list[AcceptItem]) -> list[AcceptResult]:
        """The batch's one transaction (handing its new tasks to idle workers with a
        ``handoff``); no Redis call happens inside it."""
        handoff = self._handoff
        return self.tasks.accept(items) if handoff is None else handoff.accept(self.tasks, items)

    def _after_commit(
        self,
        source: _Source,
        batch: Checked[AcceptItem],
        results: list[AcceptResult],
        started: int,
    ) -> list[str]:
        """Count the outcomes, apply the batch's cancels, dead-letter what the transaction
        refused; returns the entry ids to acknowledge."""
        reader = source.reader
        to_ack: list[str] = []
        for entry, item, result in zip(batch.entries, batch.items, results, strict=True):
            refusal = result.refusal
            if refusal is not None and item.envelope.kind == CANCEL_KIND:
                refusal = self._cancel(item)  # after the batch's commit, its own transaction
                if refusal is None:
                    to_ack.append(entry.entry_id)
                    continue
                if refusal is _NOT_NOW:
                    continue  # stays pending: taken over and applied again later
            if refusal is not None:
                # Nothing was written for it (NOT_TASK: results never become tasks by
                # themselves; REFUSED: a deadline beyond the retention window).
                reader.dead_letters.write(
                    entry,
                    refusal.reason,
                    refusal.detail,
                    extra={deadletter.FIELD: refusal.field, deadletter.PRINCIPAL: item.principal},
                    trusted=True,  # authenticated and admitted: the whole entry is copied
                )
                continue
            name = _OUTCOME_COUNTER.get(result.outcome)
            if name is not None:
                setattr(self.stats, name, getattr(self.stats, name) + 1)
            if result.outcome is Outcome.CONFLICT:
                self.log.warning(
                    "conflict: %s reused message_id %r with other content (entry %s)",
                    item.principal,
                    item.envelope.message_id,
                    entry.entry_id,
                )
            to_ack.append(entry.entry_id)
        tracing.ingested(batch.items, results, started)
        return to_ack

    def _cancel(self, item: AcceptItem) -> EnvelopeError | None:
        """Apply a ``cancel`` envelope (``cancels.apply_cancel``): ``None`` when done,
        the refusal to dead-letter, or ``_NOT_NOW`` when the database was busy."""
        try:
            task_id, state = apply_cancel(self.tasks, item.principal, item.envelope)
        except EnvelopeError as exc:
            return exc
        except TransientError as exc:
            self.log.warning("cancel %r not applied yet: %s", item.envelope.message_id, exc)
            return _NOT_NOW
        self.log.info(
            "cancel %r of %s: task %s %s",
            item.envelope.message_id,
            item.principal,
            task_id,
            state.value,
        )
        return None

    def _sync_stats(self) -> None:
        merged: dict[str, int] = {}
        for source in self._sources:
            for reason, n in source.reader.stats.by_reason.items():
                merged[reason] = merged.get(reason, 0) + n
        self.stats.dead_lettered = merged
        self.stats.acked = sum(source.consumer.acked for source in self._sources)
