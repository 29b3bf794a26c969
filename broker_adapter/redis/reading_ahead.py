"""Reading ahead: a group reader's next read sent before it is asked for (``ReadingAhead``).

Reading ahead is allowed only into the reader's own pending list: a peeking ``ack`` reads
the next batch in its round trip, and after a whole batch ``prefetch`` sends the next read
at once, so that Redis prepares it while the batch is checked and committed. What was read
ahead and not yet handled is dropped on any error and comes back with the replay.
``GroupReader`` holds the state and the reading these methods use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from broker_adapter.errors import BrokerAdapterError, GroupMissingError
from broker_adapter.redis import cluster
from broker_adapter.redis.client import translated
from broker_adapter.redis.entry import StreamEntry
from broker_adapter.redis.internals import discard, exchange, read_ahead, send_ahead

if TYPE_CHECKING:
    import redis

    from broker_adapter.redis.reader_config import ReaderStats
    from broker_adapter.redis.screening import Screened, ScreenedReads


class ReadingAhead:
    """The reading ahead of ``GroupReader`` (its base class)."""

    client: redis.Redis
    stream: str
    group: str
    stats: ReaderStats
    reads: ScreenedReads
    _ahead: list[StreamEntry]  # (their meaning: ``GroupReader.__init__``)
    _inflight: Any
    _full: bool
    _replaying: bool

    # The reading these methods use (``GroupReader``'s).

    def reset(self) -> None:
        raise NotImplementedError

    def ack(self, entry_ids: Sequence[str], *, peek: bool = False) -> int:
        raise NotImplementedError

    def _recreate_group(self) -> None:
        raise NotImplementedError

    def _screened(self, done: Screened) -> Screened:
        raise NotImplementedError

    def _counted(self, done: Screened) -> list[StreamEntry]:
        raise NotImplementedError

    def _screen(self, batch: list[StreamEntry]) -> list[StreamEntry]:
        raise NotImplementedError

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

    def _ack_and_read(self, xack: tuple[str, ...], entry_ids: Sequence[str]) -> int:
        """``ack``'s peek: send ``xack`` and a read of new entries in one round trip; the
        entries read wait for the next ``read``."""
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
