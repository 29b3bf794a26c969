"""Writing dead letters for a group reader: the refused entry moves to the dead-letter
stream with its reason and is acknowledged, in ONE call of the Redis Function
``ba_dead_letter`` (``redis.functions``: atomic, even across an AOF tail loss, and callable
by users that may not run scripts of their own), so that it is neither looped on nor
silently dropped. The entry format is ``broker_adapter.protocol.deadletter``'s.

The function's argument list is bounded whatever a writer put in the entry: a dead letter
copies at most ``max_entry_fields`` fields and ``max_entry_bytes`` bytes of it, and of an
entry not authenticated and admitted (``trusted=False``, the default) a prefix of
``UNTRUSTED_COPY_BYTES``. The dead-letter stream is capped (``cap`` entries): the function
trims the oldest beyond it, and the writer counts them (``stats.dead_letters_capped``) and
raises an alarm.

Dead-lettering is isolated per entry: a dead letter that fails for any reason but a
transient one is replaced by a minimal one (reason ``internal_error``, no copied fields),
and if even that fails the entry is acknowledged with an alarm, so that no entry can stop
the reader or hold up the rest of its batch. (Of a larger entry a dead letter copies what
fits and says so in ``dl.truncated``; the entry itself stays in its stream under
``dl.entry_id`` until the stream's trim passes it: acknowledged entries are kept
``min(trim_keep_s, retention_s)``, five minutes by default, see ``trimming``.)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from broker_adapter.errors import BrokerAdapterError, TransientError
from broker_adapter.protocol import deadletter
from broker_adapter.protocol.deadletter import (
    DEFAULT_DEAD_LETTER_CAP,
    INTERNAL_ERROR,
    UNTRUSTED_COPY_BYTES,
    describe,
    encodable,
)
from broker_adapter.redis.client import text, translated
from broker_adapter.redis.entry import StreamEntry
from broker_adapter.redis.functions import DEAD_LETTER, fcall_many
from broker_adapter.redis.internals import exchange

if TYPE_CHECKING:
    import redis


class EntryLimits(Protocol):
    """How much of an entry a dead letter copies (a reader's ``ReaderConfig``)."""

    @property
    def max_entry_fields(self) -> int: ...

    @property
    def max_entry_bytes(self) -> int: ...


class DeadLetterCounters(Protocol):
    """The counters a writer moves (a reader's ``ReaderStats``)."""

    dead_lettered: int
    dead_letter_failures: int
    dead_letters_capped: int
    by_reason: dict[str, int]


class DeadLetterWriter:
    """The dead letters of one reader (one stream, group and consumer).

    Args:
        client: the reader's client.
        stream: the stream the entries come from.
        group: the reader's group.
        consumer: the reader's consumer name.
        dead_stream: where the dead letters go (same hash tag as ``stream``).
        config: the reader's limits (``max_entry_fields``, ``max_entry_bytes``: how much a
            dead letter copies).
        stats: the reader's counters (``dead_lettered``, ``by_reason``,
            ``dead_letter_failures`` move here).
        logger: where alarms go.
        cap: the most entries the dead-letter stream keeps (0: no cap).
    """

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        group: str,
        consumer: str,
        dead_stream: str,
        config: EntryLimits,
        stats: DeadLetterCounters,
        logger: logging.Logger,
        cap: int = DEFAULT_DEAD_LETTER_CAP,
    ) -> None:
        self.client = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.dead_stream = dead_stream
        self.config = config
        self.stats = stats
        self.log = logger
        self.cap = cap

    def write(
        self,
        entry: StreamEntry,
        reason: str,
        detail: str,
        extra: Mapping[str, str] | None = None,
        *,
        trusted: bool = False,
    ) -> str | None:
        """Move ``entry`` to the dead-letter stream with its reason, and XACK it, atomically.

        Whatever the entry holds, this does not fail because of it: a dead letter Redis
        refuses (or that cannot be built) is replaced by a minimal one with reason
        ``internal_error`` and no copied fields; if even that is refused, the entry is
        acknowledged alone and an alarm logged (``stats.dead_letter_failures``), so that it
        does not come back and stop the reader again.

        Args:
            entry: the entry to move.
            reason: machine-readable reason code (``dl.reason``).
            detail: human-readable explanation (``dl.detail``, cut to 1000 characters).
            extra: more ``dl.*`` fields to record, e.g. ``{"dl.field": "payload"}``. Texts
                are made encodable (``encodable``): they may come from input.
            trusted: the entry was authenticated and admitted: the copy may hold up to
                ``max_entry_bytes`` (else ``UNTRUSTED_COPY_BYTES``).

        Returns:
            the dead-letter entry's id, or None when none could be written.

        Raises:
            TransientError: Redis could not be reached (the entry stays pending; maybe
                moved).
            BrokerAdapterError: the last resort, the XACK alone, was refused (the group is
                gone, say): a problem of the stream, not of the entry.
        """
        return self.write_fields(
            entry.entry_id,
            reason,
            detail,
            entry.deliveries,
            original=entry.flat(),
            extra=extra,
            trusted=trusted,
        )

    def write_exception(self, entry: StreamEntry, exc: Exception, doing: str) -> None:
        """Dead-letter ``entry`` as ``internal_error``: handling it raised ``exc`` (a bug, or
        input no check foresaw). The exception class goes into ``dl.detail``; the traceback
        goes to the log.

        Args:
            doing: what was being done to the entry, for the detail (``"checking it"``).
        """
        self.log.error(
            "ALARM: %s raised while %s entry %s of %s; dead-lettering it as internal_error",
            type(exc).__name__,
            doing,
            entry.entry_id,
            self.stream,
            exc_info=exc,
        )
        detail = f"{describe(exc)} while {doing}"
        self.write(entry, INTERNAL_ERROR, detail, {deadletter.FIELD: ""})

    def write_many(self, refused: Sequence[tuple[StreamEntry, str, str, Mapping[str, str]]]) -> int:
        """``dead_letter`` for many entries, pipelined in one round trip (the script runs
        once per entry, each atomic on its own), with one log line per reason: the path
        for a flood refused by the ingress limits, where a round trip and a log line per
        entry would cost more than accepting it. An entry whose script Redis refused goes
        through ``dead_letter`` alone (with its fallbacks).

        Args:
            refused: ``(entry, reason, detail, extra)`` per entry.

        Returns:
            how many were dead-lettered.

        Raises:
            RedisUnavailable: the round trip failed; any prefix of the calls may have run.
        """
        calls = []
        for e, reason, detail, extra in refused:
            notes, copy = self._letter(
                e.entry_id, reason, detail, e.deliveries, e.flat(), extra, trusted=False
            )
            calls.append(([self.stream, self.dead_stream], self._argv(e.entry_id, notes, copy)))
        results = fcall_many(self.client, DEAD_LETTER, calls)
        reasons: dict[str, int] = {}
        written = 0
        for (entry, reason, detail, extra), result in zip(refused, results, strict=True):
            if isinstance(result, BrokerAdapterError):
                written += self.write(entry, reason, detail, extra) is not None
                continue
            self._count_capped(result)
            reasons[reason] = reasons.get(reason, 0) + 1
        for reason, n in reasons.items():
            self.stats.dead_lettered += n
            self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + n
            self.log.warning("dead-lettered %d entries from %s: %s", n, self.stream, reason)
        return written + sum(reasons.values())

    def write_fields(
        self,
        entry_id: str,
        reason: str,
        detail: str,
        deliveries: int,
        *,
        original: Sequence[bytes] = (),
        ack: bool = True,
        extra: Mapping[str, str] | None = None,
        trusted: bool = False,
    ) -> str | None:
        """Dead-letter the entry ``entry_id`` of ``original`` fields (flat pairs; none when
        its payload is gone), with the fallbacks. ``ack=False``: the entry left the pending
        list already (XAUTOCLAIM's deleted ids); ``trusted``: as ``write``."""
        try:
            notes, copy = self._letter(
                entry_id, reason, detail, deliveries, original, extra, trusted=trusted
            )
            dead_id = self._move(entry_id, notes, copy, ack=ack)
        except TransientError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the entry held: a minimal one
            self.log.error(
                "ALARM: dead letter %r of %s from %s failed (%s: %s); writing a minimal one",
                reason,
                entry_id,
                self.stream,
                type(exc).__name__,
                exc,
            )
            minimal = deadletter.minimal_notes(reason, exc, source=self.stream, entry_id=entry_id)
            try:
                dead_id = self._move(entry_id, minimal, [], ack=ack)
            except TransientError:
                raise
            except Exception as last:  # noqa: BLE001 - acknowledged, with an alarm
                self._give_up(entry_id, reason, last, ack=ack)
                return None
            reason, detail = INTERNAL_ERROR, minimal[deadletter.DETAIL]
        self.stats.dead_lettered += 1
        self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + 1
        self.log.warning(
            "dead-lettered %s from %s: %s (%s)", entry_id, self.stream, reason, encodable(detail)
        )
        return dead_id

    def _letter(
        self,
        entry_id: str,
        reason: str,
        detail: str,
        deliveries: int,
        original: Sequence[bytes],
        extra: Mapping[str, str] | None,
        *,
        trusted: bool,
    ) -> tuple[dict[str, str], list[bytes]]:
        """The ``dl.*`` notes and the bounded ``orig.*`` copy of one dead letter."""
        notes = deadletter.notes(
            reason,
            detail,
            source=self.stream,
            entry_id=entry_id,
            deliveries=deliveries,
            group=self.group,
            consumer=self.consumer,
            extra=extra,
        )
        cfg = self.config
        max_bytes = cfg.max_entry_bytes
        if not trusted:
            max_bytes = min(max_bytes, UNTRUSTED_COPY_BYTES)
        copy, truncated = deadletter.copy_original(
            original, max_fields=cfg.max_entry_fields, max_bytes=max_bytes, source=self.stream
        )
        if truncated:
            notes[deadletter.TRUNCATED] = truncated
        return notes, copy

    def _argv(
        self, entry_id: str, notes: Mapping[str, str], copy: Sequence[bytes], *, ack: bool = True
    ) -> list[bytes | str]:
        """The dead-letter function's ARGV: the group, the entry to acknowledge, the cap,
        the fields."""
        argv: list[bytes | str] = [self.group, entry_id if ack else "0-0", str(self.cap)]
        argv += deadletter.entry_fields(notes, copy)
        return argv

    def _move(
        self, entry_id: str, notes: Mapping[str, str], copy: Sequence[bytes], *, ack: bool
    ) -> str:
        """Call the dead-letter function for one entry."""
        argv = self._argv(entry_id, notes, copy, ack=ack)
        (result,) = fcall_many(self.client, DEAD_LETTER, [([self.stream, self.dead_stream], argv)])
        if isinstance(result, Exception):
            raise result
        self._count_capped(result)
        return text(result[0])

    def _count_capped(self, result: Sequence[object]) -> None:
        """Count and report the dead letters the cap trimmed (the function's second
        result)."""
        trimmed = int(result[1])  # type: ignore[call-overload]
        if trimmed:
            self.stats.dead_letters_capped += trimmed
            self.log.error(
                "ALARM: dead-letter stream %s is at its cap of %d entries; its %d oldest "
                "dead letters were trimmed (read them with `dead-letters list` sooner, or find "
                "who floods %s)",
                self.dead_stream,
                self.cap,
                trimmed,
                self.stream,
            )

    def _give_up(self, entry_id: str, reason: str, exc: Exception, *, ack: bool) -> None:
        """The last resort when no dead letter can be written: acknowledge the entry alone,
        so that it cannot stop the reader on every replay, and say so loudly. (It is not
        deleted: it stays in the stream under its id.)"""
        self.stats.dead_letter_failures += 1
        self.log.error(
            "ALARM: no dead letter could be written for %s of %s (%s; %s: %s); acknowledging "
            "it without one (it stays in the stream under its id)",
            entry_id,
            self.stream,
            reason,
            type(exc).__name__,
            exc,
        )
        if ack:
            with translated():
                exchange(self.client, [("XACK", self.stream, self.group, entry_id)], raw=True)
