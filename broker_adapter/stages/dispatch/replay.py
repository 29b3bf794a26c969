"""The operator's replay of a ``dead`` reply, reconciled against Redis first.

A ``dead`` row (no trusted confirmation within its retry budget, or a content conflict) is
replayed by hand (``broker-adapter dead-letters replay``). Redis is asked first, by reply
id: the publication record (``publish``) while it lives, else the reply stream itself from
shortly before the row was written (bounded: the streams are trimmed to what their groups
have not acknowledged). Found with the same content: the row is marked sent with that entry
id, nothing re-sent; found with other content: a conflict to resolve by hand; not found:
the row goes back in line under the same reply id, for a running dispatcher to publish.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from typing import TYPE_CHECKING, Any

from broker_adapter.errors import ReplyConflict, StaleError
from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import call, text
from broker_adapter.redis.trimming import time_id
from broker_adapter.store.outbox import OutboxStore
from broker_adapter.store.outbox_types import OutboxRow, UnknownReply

if TYPE_CHECKING:
    from broker_adapter.redis.client import Redis

#: The operator's replay looks for a reply in its stream from this long before the row was
#: written (entry ids carry the server's clock, ``created_at`` this process's).
REPLAY_SCAN_SKEW_S = 60.0
#: ... through at most this many entries, in pages of ``REPLAY_SCAN_PAGE``.
REPLAY_SCAN_MAX_ENTRIES = 100_000
REPLAY_SCAN_PAGE = 1000


class ReplayOutcome(StrEnum):
    ALREADY_PUBLISHED = "already_published"  # Redis has it: marked sent, nothing re-sent
    REQUEUED = "requeued"  # back in line under the same reply id


@dataclass(frozen=True)
class ReplayResult:
    reply_id: str
    outcome: ReplayOutcome
    entry_id: str | None = None


def _parse_record(raw: bytes | str) -> tuple[str, str | None]:
    stored, _, entry_id = text(raw).partition(" ")
    return stored, entry_id or None


class Replayer:
    """Lists and replays ``dead`` replies (see the module's text).

    Args:
        client: a client from ``redis.client.connect``.
        outbox: the outbox of this process's database.
        keys: the key layout.
        logger: where replays are reported.
    """

    def __init__(
        self,
        client: Redis,
        outbox: OutboxStore,
        keys: Keys,
        logger: logging.Logger | None = None,
    ) -> None:
        self.client = client
        self.outbox = outbox
        self.keys = keys
        self.log = logger or logging.getLogger("broker_adapter.stages.dispatcher")

    def list_dead(self, limit: int = 1000) -> list[OutboxRow]:
        """Replies with no trusted confirmation, oldest first, each with its ``last_error``."""
        return self.outbox.list("dead", limit)

    def replay(self, reply_id: str, by: str) -> ReplayResult:
        """Operator action on a ``dead`` reply, reconciled against Redis first.

        If Redis holds the reply's publication record with the same content hash, the reply
        was published: the row is marked sent with that entry id and nothing is re-sent.
        Without a record (it lives ``record_window_s``) the reply stream itself is searched,
        from shortly before the row was written: an entry there under this reply id counts
        as the record would. Otherwise the row is put back in line under the same reply id.
        Either way the row records who replayed it and when. (A reply whose entry was
        trimmed, read by every group or unread past the retention window, is published
        again under its id; the receiver's receipts dedupe it.)

        Raises:
            UnknownReply: no such reply.
            StaleError: the row is not ``dead``.
            ReplyConflict: Redis holds this reply id with other content; resolve by hand.
            RedisUnavailable: the record could not be read; nothing was changed.
        """
        row = self.outbox.get(reply_id)
        if row is None:
            raise UnknownReply(reply_id)
        if row.state != "dead":
            raise StaleError(reply_id, "not_dead", f"state is {row.state}")
        key = self.keys.reply_record(row.principal, reply_id)
        raw = call(lambda: self.client.get(key))
        found = _parse_record(raw) if raw is not None else self._find_in_stream(row)
        if found is not None:
            stored, entry_id = found
            if stored != row.content_hash or entry_id is None:
                raise ReplyConflict(reply_id, stored, row.content_hash)
            self.outbox.mark_published(reply_id, entry_id, by)
            self.log.warning(
                "replay of %s by %s: already published as %s; marked sent",
                reply_id,
                by,
                entry_id,
            )
            return ReplayResult(reply_id, ReplayOutcome.ALREADY_PUBLISHED, entry_id)
        self.outbox.replay(reply_id, by)
        self.log.warning("replay of %s by %s: put back in line", reply_id, by)
        return ReplayResult(reply_id, ReplayOutcome.REQUEUED)

    def _find_in_stream(self, row: OutboxRow) -> tuple[str, str | None] | None:
        """``(content hash, entry id)`` of the first entry of the row's reply stream under its
        reply id, from ``REPLAY_SCAN_SKEW_S`` before the row was written; ``None`` if none is
        found within ``REPLAY_SCAN_MAX_ENTRIES`` entries (the streams are trimmed, so the
        scan is bounded by what their groups have not acknowledged yet)."""
        stream = self.keys.replies(row.principal)
        start = time_id((row.created_at - REPLAY_SCAN_SKEW_S) * 1000)
        wanted = row.reply_id.encode()
        seen = 0
        while seen < REPLAY_SCAN_MAX_ENTRIES:
            page: Any = call(partial(self.client.xrange, stream, start, "+", REPLAY_SCAN_PAGE))
            for eid, fields in page:
                if fields.get(b"reply_id") == wanted:
                    return text(fields.get(b"hash", b"")), text(eid)
            if len(page) < REPLAY_SCAN_PAGE:
                return None
            seen += len(page)
            start = "(" + text(page[-1][0])
        self.log.warning(
            "replay of %s: no record, and not among the first %d entries of %s",
            row.reply_id,
            seen,
            stream,
        )
        return None
