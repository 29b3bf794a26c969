"""One consumer of one stream's group: read or replay, screen, commit, acknowledge.

The ingest (``ingest.Ingestor``: envelopes into the inbox) and the receiver
(``receiver.Receiver``: replies into receipts) consume a stream the same way; a
``GroupConsumer`` is that way, and each stage gives it what is its own as three callbacks:
how a batch is screened (``Screen``: bad entries dead-lettered, each on its own), the
transaction that commits the rest (``Commit``), and what follows the commit (``Settle``:
outcomes counted, refusals dead-lettered, the entries to acknowledge chosen).

The order it keeps (``docs/RULES.md`` rules 5 and 15): the commit, then its crash point,
then ONE XACK for the batch (with ``peek``, the next new entries are read in the same
round trip), then the XACK's crash point. No Redis call happens inside the transaction.

* A batch whose transaction found the store busy (``StoreBusy``) is held and committed as
  it is by the next ``step``, without reading its entries again: a store outage does not
  raise their delivery counts towards the reader's poison limit.
* After any other error the reader is reset: its next read replays this consumer's own
  pending list before anything new.
* The stage's loop (``loop.run_stage``) ends at stop with a drain: steps without ``peek``
  while the reader has entries read ahead (``GroupReader.has_ahead``), so that a clean stop
  leaves nothing read and unhandled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from broker_adapter import crashpoints
from broker_adapter.errors import ConfigError, StoreBusy
from broker_adapter.redis.cluster import socket_timeout
from broker_adapter.redis.entry import StreamEntry
from broker_adapter.redis.reader import GroupReader
from broker_adapter.stages.shared import tracing

#: What a stage commits for one entry (``AcceptItem``, ``ReceiptItem``).
ItemT = TypeVar("ItemT")
#: What its transaction says about one item (``AcceptResult``, ``AppliedItem``).
ResultT = TypeVar("ResultT")


@dataclass
class Checked(Generic[ItemT]):
    """A screened batch: the entries that passed and, in the same order, their items."""

    entries: list[StreamEntry] = field(default_factory=list)
    items: list[ItemT] = field(default_factory=list)

    def add(self, entry: StreamEntry, item: ItemT) -> None:
        self.entries.append(entry)
        self.items.append(item)


#: Checks a batch: dead-letters each entry that fails on its own and returns the rest
#: (raises ``TransientError`` when a check could not be made).
Screen = Callable[[list[StreamEntry]], Checked[ItemT]]
#: The one transaction of a batch (no Redis call inside); ``StoreBusy`` holds the batch.
Commit = Callable[[list[ItemT]], list[ResultT]]
#: After the commit: counts the outcomes, dead-letters what the transaction refused, and
#: returns the entry ids to acknowledge (its last argument: ``tracing.now()`` before the
#: transaction).
Settle = Callable[[Checked[ItemT], list[ResultT], int], list[str]]


@dataclass(frozen=True)
class CrashPoints:
    """The stage's crash point names (``crashpoints.POINTS``); ``None``: the stage has none
    there."""

    after_commit: str
    after_xack: str
    after_read: str | None = None
    after_take_over: str | None = None
    before_commit: str | None = None


class Step(NamedTuple):
    """What one ``step`` did.

    Attributes:
        handled: entries handled: read (stored, refused or dead-lettered) or held.
        acked: entries the stage asked to acknowledge.
    """

    handled: int
    acked: int


def check_block_timeout(client: object, block_ms: int) -> None:
    """Refuse a client whose socket timeout would cut a read blocking ``block_ms`` short.

    Raises:
        ConfigError: the socket timeout is not above ``block_ms``.
    """
    timeout = socket_timeout(client)
    if timeout is not None and float(timeout) * 1000 <= block_ms:
        raise ConfigError(
            f"client socket timeout {timeout}s must exceed block_ms={block_ms}: a blocked "
            "read would otherwise look like a dead connection"
        )


class GroupConsumer(Generic[ItemT, ResultT]):
    """Consumes one stream's group through ``reader`` for a stage.

    Args:
        reader: the group reader of the stream.
        points: the stage's crash point names.
        screen: the stage's checks of a batch (``Screen``).
        commit: the stage's transaction (``Commit``).
        settle: what the stage does after its commit (``Settle``).
    """

    def __init__(
        self,
        reader: GroupReader,
        points: CrashPoints,
        *,
        screen: Screen[ItemT],
        commit: Commit[ItemT, ResultT],
        settle: Settle[ItemT, ResultT],
    ) -> None:
        self.reader = reader
        self.points = points
        self._screen = screen
        self._commit = commit
        self._settle = settle
        #: A checked batch whose transaction found the store busy: committed as it is next.
        self.held: Checked[ItemT] | None = None
        #: Entries acknowledged since start (what XACK counted).
        self.acked = 0

    @contextmanager
    def resetting(self) -> Iterator[None]:
        """Reset the reader after any error but ``StoreBusy`` (the batch is held then): its
        next read replays this consumer's pending list before new entries."""
        try:
            yield
        except StoreBusy:
            raise
        except BaseException:
            self.reader.reset()
            raise

    def step(
        self,
        *,
        block: bool = True,
        peek: bool = True,
        take_over: Callable[[], list[StreamEntry]] | None = None,
    ) -> Step:
        """Commit the held batch, or read one (own pending first), screen, commit and
        acknowledge it.

        Args:
            block: let a read of new entries wait up to the reader's ``block_ms``.
            peek: read the next new entries in the round trip of this batch's XACK (after a
                whole batch, that read is sent before the batch is checked:
                ``GroupReader.prefetch``).
            take_over: called after the read; the entries it returns (a take-over page)
                join the batch.

        Raises:
            TransientError: Redis or the store failed; call again (the reader replays
                first, or the held batch is committed).
        """
        with self.resetting():
            held = self.held
            if held is not None:
                return Step(len(held.entries), self.commit(held, peek=peek))
            entries = self.reader.read(block=block)
            if entries:
                self._hit(self.points.after_read)
                if peek:
                    self.reader.prefetch()  # the next batch, prepared meanwhile
            if take_over is not None:
                entries += take_over()
            if not entries:
                return Step(0, 0)
            return Step(len(entries), self.handle(entries, peek=peek))

    def take_over(self) -> list[StreamEntry]:
        """One page of entries idle past the reader's ``claim_min_idle_ms`` in any
        consumer's list (a dead process's), claimed for this one (XAUTOCLAIM). Outside
        ``step``, reset the reader after an error."""
        entries = self.reader.take_over()
        if entries:
            self._hit(self.points.after_take_over)
        return entries

    def handle(self, entries: list[StreamEntry], *, peek: bool = False) -> int:
        """Screen ``entries``, then commit and acknowledge those that pass. Outside
        ``step``, reset the reader after an error.

        Returns:
            how many entries the stage asked to acknowledge.
        """
        batch = self._screen(entries)
        if not batch.items:
            return 0
        return self.commit(batch, peek=peek)

    def commit(self, batch: Checked[ItemT], *, peek: bool = False) -> int:
        """The batch's transaction, then ONE XACK (commit before XACK: a crash between the
        two leaves the entries pending, and their redelivery meets what was committed).

        Returns:
            how many entries the stage asked to acknowledge.
        """
        self._hit(self.points.before_commit)
        started = tracing.now()
        try:
            results = self._commit(batch.items)
        except StoreBusy:
            self.held = batch  # retried as it is: no re-read, no redelivery
            raise
        self.held = None
        crashpoints.hit(self.points.after_commit)
        ids = self._settle(batch, results, started)
        self.acked += self.reader.ack(ids, peek=peek)
        crashpoints.hit(self.points.after_xack)
        return len(ids)

    @staticmethod
    def _hit(point: str | None) -> None:
        if point is not None:
            crashpoints.hit(point)
