"""Screened reads: entries measured inside Redis before any of them crosses the network.

A reader that measured entries once they had arrived would hold a whole batch of them,
however large, before any check ran. So the reads of a ``GroupReader`` go through a Redis
Function (library ``ba_screen_1``, its Lua and what it does in ``screening_lua``; loaded by
whoever reads first: ``FUNCTION LOAD REPLACE``, idempotent) that takes the entries one at a
time inside Redis, returns those within the limits and dead-letters the others there. This
module builds its calls, decodes its replies, and falls back when it cannot be called.

An entry delivered to the reader inside the call but left out because the budget was spent
stays in the reader's pending list; the reply says so (``left``) and the reader replays its
pending list next, which returns it.

Three read shapes share the function: new entries (``>``), the reader's own pending list
(an id, typically ``0``), and a takeover page (XAUTOCLAIM from a cursor). Functions cannot
block: when a screened read of new entries finds nothing, the reader blocks with a plain
``XREADGROUP ... COUNT 1 BLOCK``, which holds at most ONE entry it has not measured; the
deployment's ``client-query-buffer-limit`` and ``proto-max-bulk-len`` bound that entry
(docs/OPERATIONS.md, "Redis memory and entry size").

A read of new entries of an inbound stream also moves the stream's submit list into it
first, in the same call (``admission``); an idle reader of such a stream waits on the list
(``wait``: ``BLMOVE <list> <list> RIGHT RIGHT`` leaves the item where it was).

When the function cannot be called (a user without ``+fcall``, a Redis before 7.0, a
function that is not loaded and the user may not load it) the reader falls back to plain
reads of ONE entry each, measured in the process, and logs an alarm; it tries the function
again every ``RETRY_EVERY_READS`` reads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from broker_adapter.errors import BrokerAdapterError, GroupMissingError, TransientError
from broker_adapter.redis.admission import (
    ITEM_EXPANSION,
    Admitted,
    admission_refused,
    parse_admitted,
    wait_for_item,
)
from broker_adapter.redis.client import text, translated
from broker_adapter.redis.entry import StreamEntry
from broker_adapter.redis.internals import exchange, reply_entries, stream_entries
from broker_adapter.redis.screening_lua import CLAIM_FUNCTION, READ_FUNCTION, SOURCE

if TYPE_CHECKING:
    import redis

#: A reader in fallback mode tries the function again after this many reads.
RETRY_EVERY_READS = 256


@dataclass(frozen=True)
class ScreenLimits:
    """What a screened read lets through.

    Attributes:
        count: the most entries one call looks at.
        max_fields: entries of more fields are dead-lettered (``too_many_fields``).
        max_bytes: entries of more bytes (names and values) are dead-lettered
            (``oversize``).
        budget: the bytes of entries one call returns (and looks at) at most; the first
            entry is always returned.
        copy_bytes: the most bytes of a refused entry its dead letter copies.
        max_deliveries: a refused entry delivered more often is dead-lettered as
            ``delivery_limit`` (the reader's first check) instead.
    """

    count: int
    max_fields: int
    max_bytes: int
    budget: int
    copy_bytes: int
    max_deliveries: int


@dataclass(frozen=True)
class Screened:
    """What one screened call returned.

    Attributes:
        entries: the entries that passed (deleted ones with ``fields=None``).
        refused: ``(entry id, reason)`` of each entry dead-lettered inside Redis.
        left: an entry was delivered but not returned: replay the pending list next.
        cursor: the takeover's next cursor (``""`` for reads).
        deleted: ids XAUTOCLAIM found deleted (they left the pending list).
        admitted: what the read moved from the submit list first (None: it moved
            nothing, or had no list).
    """

    entries: list[StreamEntry]
    refused: list[tuple[str, str]]
    left: bool
    cursor: str = ""
    deleted: Sequence[str] = ()
    admitted: Admitted | None = None


def _limit_args(limits: ScreenLimits) -> list[int]:
    return [
        limits.count,
        limits.max_fields,
        limits.max_bytes,
        limits.budget,
        limits.copy_bytes,
        limits.max_deliveries,
    ]


def read_command(
    stream: str,
    dead: str,
    group: str,
    consumer: str,
    start: str,
    limits: ScreenLimits,
    submit: str | None = None,
) -> tuple[Any, ...]:
    """The FCALL of a screened read of ``stream`` from ``start`` (``>``: new entries; an
    id: this consumer's pending entries after it), moving items of the ``submit`` list into
    the stream first when one is given (at most ``count`` items, ``budget`` bytes)."""
    args = (group, consumer, *_limit_args(limits), start)
    if submit is None:
        return ("FCALL", READ_FUNCTION, 2, stream, dead, *args)
    item_bytes = ITEM_EXPANSION * limits.max_bytes
    return ("FCALL", READ_FUNCTION, 3, stream, dead, submit, *args, limits.count, item_bytes)


def claim_command(
    stream: str,
    dead: str,
    group: str,
    consumer: str,
    cursor: str,
    min_idle_ms: int,
    limits: ScreenLimits,
) -> tuple[Any, ...]:
    """The FCALL of a screened takeover page (XAUTOCLAIM from ``cursor``)."""
    return (
        "FCALL",
        CLAIM_FUNCTION,
        2,
        stream,
        dead,
        group,
        consumer,
        *_limit_args(limits),
        cursor,
        min_idle_ms,
    )


def load_command() -> tuple[Any, ...]:
    """The command that loads (or replaces) the library."""
    return ("FUNCTION", "LOAD", "REPLACE", SOURCE)


def parse(reply: Any) -> Screened:
    """The ``Screened`` of a raw (RESP2) reply of either function."""
    cursor, left, items, refused, deleted, *rest = reply
    admitted = parse_admitted(rest[0]) if rest else None
    return Screened(
        entries=stream_entries(items),
        refused=[(text(r[0]), text(r[1])) for r in refused or ()],
        left=bool(int(left)),
        cursor=text(cursor),
        deleted=[text(d) for d in deleted or ()],
        admitted=admitted,
    )


def is_missing(exc: BaseException) -> bool:
    """Whether an error reply says the function is not loaded (load it, then call again)."""
    return "function not found" in str(exc).lower()


def is_unavailable(exc: BaseException) -> bool:
    """Whether an error reply says this user or server cannot run the function at all (no
    ``+fcall`` or ``+function|load``, or a Redis before 7.0): read without it."""
    said = str(exc).lower()  # redis-py drops the NOPERM code word from its message
    return any(w in said for w in ("noperm", "no permissions", "unknown command"))


class ScreenedReads:
    """The reads of one group reader (one stream, group and consumer), screened when the
    function can be called and one entry at a time when it cannot (see the module's text).

    Args:
        client: the reader's client.
        stream: the stream read.
        dead: its dead-letter stream.
        group: the reader's group.
        consumer: the reader's consumer name.
        limits: what a read lets through.
        logger: where the fallback's alarm goes.
        submit: the stream's submit list, whose items each read of new entries moves into
            the stream first (``admit``), and on which an idle reader waits; None: none.
    """

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        dead: str,
        group: str,
        consumer: str,
        limits: ScreenLimits,
        logger: logging.Logger,
        submit: str | None = None,
    ) -> None:
        self.client = client
        self.stream = stream
        self.dead = dead
        self.group = group
        self.consumer = consumer
        self.limits = limits
        self.log = logger
        #: Whether the function works (None: not known yet, the next read finds out).
        self.screening: bool | None = None
        #: The last call's reply came from a plain read (the function could not be used).
        self.plain_reply = False
        self._unscreened_reads = 0
        self.submit = submit
        #: Whether reads may move the submit list (False: this user may not, see ``_call``).
        self.admitting = submit is not None
        #: Whether an idle reader may wait on the submit list (False: no BLMOVE right).
        self.waiting_on_submit = submit is not None
        self._unadmitted_reads = 0

    # -- commands ---------------------------------------------------------------------------

    def read_command(self, start: str, *, block_ms: int | None = None) -> tuple[Any, ...]:
        """The command of one read from ``start`` (screened unless the function is known not
        to work, or the read blocks: a blocking read is a plain one of ONE entry)."""
        if block_ms is None and self.screening is not False:
            submit = self.submit if self.admitting and start == ">" else None
            return read_command(
                self.stream, self.dead, self.group, self.consumer, start, self.limits, submit
            )
        block = () if block_ms is None else ("BLOCK", block_ms)
        return (
            "XREADGROUP",
            "GROUP",
            self.group,
            self.consumer,
            "COUNT",
            1,
            *block,
            "STREAMS",
            self.stream,
            start,
        )

    def parse_read(self, command: Sequence[Any], reply: Any) -> Screened:
        """The ``Screened`` of the reply to ``command`` (a ``read_command``)."""
        if command[0] == "FCALL":
            return parse(reply)
        return Screened(entries=reply_entries(reply), refused=[], left=False)

    # -- calls ----------------------------------------------------------------------------

    def read(self, start: str, *, block_ms: int | None = None) -> Screened:
        """One read from ``start`` (``>`` new entries, or an id of this consumer's pending
        list), blocking ``block_ms`` if given.

        Raises:
            GroupMissingError: the group (or the stream) is gone.
            RedisUnavailable: the call failed.
        """
        self._maybe_retry()
        command = self.read_command(start, block_ms=block_ms)
        reply = self._call(command, lambda: self.read_command(start))
        if command[0] == "FCALL" and not self.plain_reply:
            if command[2] == 3 and len(reply) < 6:
                # A library loaded by an older release, whose read ignores the list: load
                # this one (it reads as the older one did for callers without a list).
                with translated():
                    _, reply = exchange(self.client, [load_command(), command], raw=True)
            return parse(reply)
        return Screened(entries=reply_entries(reply), refused=[], left=False)

    def wait(self, block_ms: int) -> None:
        """Wait up to ``block_ms`` for an item in the submit list, without taking it
        (``admission.wait_for_item``); a user without ``+blmove`` turns it off."""
        assert self.submit is not None
        if not wait_for_item(self.client, self.submit, block_ms, self.stream, self.log):
            self.waiting_on_submit = False

    def claim(self, cursor: str, min_idle_ms: int) -> Screened:
        """One takeover page from ``cursor`` (XAUTOCLAIM of entries idle ``min_idle_ms``).

        Raises:
            GroupMissingError: the group (or the stream) is gone.
            RedisUnavailable: the call failed.
        """
        self._maybe_retry()

        def command() -> tuple[Any, ...]:
            if self.screening is False:
                return (
                    "XAUTOCLAIM",
                    self.stream,
                    self.group,
                    self.consumer,
                    min_idle_ms,
                    cursor,
                    "COUNT",
                    1,
                )
            return claim_command(
                self.stream,
                self.dead,
                self.group,
                self.consumer,
                cursor,
                min_idle_ms,
                self.limits,
            )

        first = command()
        reply = self._call(first, command)
        if first[0] == "FCALL" and not self.plain_reply:
            return parse(reply)
        deleted = reply[2] if len(reply) > 2 else []
        return Screened(
            entries=stream_entries(reply[1]),
            refused=[],
            left=False,
            cursor=text(reply[0]),
            deleted=[text(d) for d in deleted],
        )

    def _call(self, command: tuple[Any, ...], fallback: Any) -> Any:
        """Run ``command``; a function not loaded is loaded in the same round trip, and a
        function that cannot be called switches this reader to plain reads (``fallback()``
        builds the command again); ``plain_reply`` says whether the reply is a plain read's."""
        self.plain_reply = False
        try:
            with translated():
                (reply,) = exchange(self.client, [command], raw=True)
        except TransientError as exc:
            if command[0] != "FCALL" or "tryagain" not in str(exc).lower():
                raise
            # A cluster slot migrating: the function's two keys may sit on two nodes for
            # now. This once, a plain read of ONE entry (its single key follows ASK).
            self.screening, was = False, self.screening
            try:
                again = fallback()
            finally:
                self.screening = was
            with translated():
                (reply,) = exchange(self.client, [again], raw=True)
            self.plain_reply = True
            return reply
        except GroupMissingError:
            raise
        except BrokerAdapterError as exc:
            if command[0] != "FCALL":
                raise
            if len(command) > 2 and command[2] == 3 and admission_refused(exc):
                return self._call(self._stop_admitting(exc, fallback), fallback)
            reply = self._load_and_call(command, exc)
            if reply is None:
                again = fallback()
                with translated():
                    (reply,) = exchange(self.client, [again], raw=True)
                self.plain_reply = True
                return reply
        if command[0] == "FCALL":
            self.screening = True
        return reply

    def _stop_admitting(self, exc: BaseException, fallback: Any) -> tuple[Any, ...]:
        """A read that moves the submit list was refused (a user without ``+lpop``): log
        the alarm, read without moving it from now on; the command to send instead."""
        self.log.error(
            "ALARM: cannot move %s into %s (%s): entries published there wait until the "
            "reader's Redis user may run LPOP, LPUSH and LLEN on it (docs/PROTOCOL.md "
            "section 9)",
            self.submit,
            self.stream,
            exc,
        )
        self.admitting = False
        command: tuple[Any, ...] = fallback()
        return command

    def _load_and_call(self, command: tuple[Any, ...], exc: BrokerAdapterError) -> Any:
        """After ``exc`` from the function: load it and call again (the reply), or fall
        back (None)."""
        if is_missing(exc):
            try:
                with translated():
                    _, reply = exchange(self.client, [load_command(), command], raw=True)
                return reply
            except (TransientError, GroupMissingError):
                raise
            except BrokerAdapterError as again:
                exc = again
        if not is_unavailable(exc):
            raise exc
        self.fall_back(exc)
        return None

    def fall_back(self, exc: BaseException) -> None:
        """Read without the function from now on (for ``RETRY_EVERY_READS`` reads)."""
        if self.screening is not False:
            self.log.error(
                "ALARM: the screening function %s cannot be used on %s (%s); reading ONE "
                "entry at a time instead, each measured only after it arrived. Grant the "
                "reader's Redis user +fcall (and the adapter +function|load), on Redis 7.0 "
                "or later (docs/OPERATIONS.md)",
                READ_FUNCTION,
                self.stream,
                exc,
            )
        self.screening = False
        self._unscreened_reads = 0

    def note_failure(self, exc: BaseException) -> None:
        """A read sent ahead (``peek``, ``prefetch``) failed with ``exc``: if the function
        is at fault, the next plain read finds out again (and loads it)."""
        if is_missing(exc) or is_unavailable(exc):
            self.screening = None
        elif self.admitting and admission_refused(exc):
            self._stop_admitting(exc, lambda: ())
            self.screening = None  # the caller reads again, plainly, and goes on

    def _maybe_retry(self) -> None:
        if self.submit is not None and not (self.admitting and self.waiting_on_submit):
            self._unadmitted_reads += 1
            if self._unadmitted_reads >= RETRY_EVERY_READS:
                self.admitting = self.waiting_on_submit = True
                self._unadmitted_reads = 0
        if self.screening is False:
            self._unscreened_reads += 1
            if self._unscreened_reads >= RETRY_EVERY_READS:
                self.screening = None
