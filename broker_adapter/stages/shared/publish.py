"""Publishing claimed outbox rows to the reply streams: the one publication path.

A shared stage helper, not a stage: the dispatcher (``dispatcher.Dispatcher``) and a worker
that publishes its own replies (``worker.Worker``) both publish through ``ReplyPublisher``,
with the same script and the same crash points (``dispatcher.before_xadd``,
``dispatcher.after_xadd``, ``dispatcher.after_mark_sent``: the names are contracts and keep
the dispatcher's name whoever publishes).

Publication is idempotent in Redis itself. ONE Lua script (``PUBLISH_SCRIPT``) on two keys of
one hash tag, ``reply_record(P, reply_id)`` and ``replies(P)``, looks up the reply's
publication record (``"<content hash> <entry id>"``) and XADDs only when there is none: no
record, a new entry (``v``, ``reply_id``, ``hash``, ``body``, ``kid``, ``sig``) and its
record (SET NX, TTL); a record with the same hash, the earlier entry id and nothing added; a
record with another hash, a permanent conflict. The script's two writes reach the AOF as
one MULTI/EXEC. Redis's own ``XADD ... IDMP`` (Redis >= 8.6, noted by ``loss.LossWatch``)
keeps ids for at most a day and does not compare content, so the script stays the path.

Every entry is signed for its principal at publish time (``signing.Keyring.sign_reply``:
``kid`` and ``sig``). The HMAC is deterministic, so publishing a row again gives the same
entry and the outbox stores nothing about it; the record dedupes by the body's content
hash, so after a key rotation a re-publish is still "already published". A row whose
principal has no key cannot be signed: it fails like an unconfirmed publication (retried
with backoff, ``dead`` past the budget) and is never published unsigned. See
``dispatcher`` for how long records live and the crash order (XADD, then mark sent).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from broker_adapter import crashpoints
from broker_adapter.errors import (
    AuthError,
    BrokerAdapterError,
    RedisUnavailable,
    StaleError,
    TransientError,
)
from broker_adapter.metric_fields import (
    DEAD_LETTERS_TRIMMED,
    REDIS_DATA_LOSS_ALARMS,
    STREAM_ENTRIES_TRIMMED,
    STREAM_FUTURE_IDS,
    TRIM_FAILURES,
    Family,
)
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.reply import CONFLICT_STATUS
from broker_adapter.protocol.signing import REPLY_WIRE_VERSION, Keyring, ReplySignature
from broker_adapter.redis.client import text
from broker_adapter.redis.scripts import eval_many
from broker_adapter.stages.shared import tracing
from broker_adapter.store import transitions
from broker_adapter.store.outbox import OutboxStore
from broker_adapter.store.outbox_types import OutboxRow

if TYPE_CHECKING:
    from broker_adapter.redis.client import Redis

#: How long a publication record dedupes its reply id (see "Publication records" in
#: ``dispatcher``).
DEFAULT_RECORD_TTL_S = 1800.0

#: How long the result record of a request (``keys.reply_result``: its signed reply, what
#: ``Client.result`` reads) lives at most (the dispatcher also purges it by its clock after
#: ``DispatcherConfig.result_window_s``).
DEFAULT_RESULT_TTL_S = 86_400.0

# KEYS[1] publication record, KEYS[2] reply stream (same hash tag); for a terminal reply
# also KEYS[3] result record, KEYS[4] result index (same hash tag).
# ARGV[1] content hash, ARGV[2] record TTL ms, ARGV[3] reply id, ARGV[4] body bytes,
# ARGV[5] entry format version, ARGV[6] key id, ARGV[7] signature; with KEYS[3]:
# ARGV[8] result TTL ms, ARGV[9] publication time ms (the index score), ARGV[10] message id.
# Returns {0, entry id} new, {1, entry id} published before with the same hash,
# {2, stored hash} conflict.
PUBLISH_SCRIPT = """
local rec = redis.call('GET', KEYS[1])
if rec then
  local stored, eid = string.match(rec, '^(%S+) (%S+)$')
  if stored == ARGV[1] then
    return {1, eid}
  end
  return {2, stored or rec}
end
local eid = redis.call('XADD', KEYS[2], '*', 'v', ARGV[5], 'reply_id', ARGV[3],
  'hash', ARGV[1], 'body', ARGV[4], 'kid', ARGV[6], 'sig', ARGV[7])
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. eid, 'PX', ARGV[2], 'NX')
if KEYS[3] then
  redis.call('DEL', KEYS[3])
  redis.call('HSET', KEYS[3], 'v', ARGV[5], 'reply_id', ARGV[3], 'hash', ARGV[1],
    'body', ARGV[4], 'kid', ARGV[6], 'sig', ARGV[7])
  redis.call('PEXPIRE', KEYS[3], ARGV[8])
  redis.call('ZADD', KEYS[4], ARGV[9], ARGV[10])
end
return {0, eid}
"""


class PublishOutcome(StrEnum):
    PUBLISHED = "published"  # a new entry
    ALREADY_PUBLISHED = "already_published"  # the record's entry, nothing added
    CONFLICT = "conflict"  # the reply id was published with other content
    FAILED = "failed"  # not confirmed: retried with backoff


@dataclass(frozen=True)
class Publication:
    """What publishing one row did.

    Attributes:
        entry_id: the reply's stream entry, for the two successful outcomes.
        detail: why it failed or conflicted.
        transient: the failure was Redis being unreachable or busy (not this row's fault).
    """

    reply_id: str
    outcome: PublishOutcome
    entry_id: str | None = None
    detail: str = ""
    transient: bool = False


#: Reply publications, of the dispatcher and of workers that publish their own replies.
REPLY_PUBLISH = Family("ba_reply_publish", "Reply publications, by outcome.", per_stage=True)


@dataclass
class DispatcherStats:
    """Counters of a publisher (``stage``: the dispatcher's, or a worker's); the exported
    ones declare their metric (``metric_fields``)."""

    published: int = REPLY_PUBLISH.field(outcome="published")
    already_published: int = REPLY_PUBLISH.field(outcome="already_published")
    conflicts: int = REPLY_PUBLISH.field(outcome="conflict")
    failed: int = REPLY_PUBLISH.field(outcome="failed")
    dead: int = REPLY_PUBLISH.field(outcome="dead")
    fenced: int = REPLY_PUBLISH.field(outcome="fenced")
    wipes: int = REDIS_DATA_LOSS_ALARMS.field(kind="wipe")
    restarts: int = REDIS_DATA_LOSS_ALARMS.field(kind="restart")
    #: Deleted epoch keys set back (Redis kept its data: not a wipe).
    epoch_restored: int = 0
    requeued: int = Family(
        "ba_replies_requeued", "Sent replies put back in line after Redis data loss."
    ).field()
    trimmed: int = STREAM_ENTRIES_TRIMMED.field()
    unread_trimmed: int = Family(
        "ba_reply_entries_unread_trimmed",
        "Replies no group acknowledged, trimmed"
        " at the retention window (their outbox rows still hold them).",
    ).field()
    dead_letters_trimmed: int = DEAD_LETTERS_TRIMMED.field()
    trim_failures: int = TRIM_FAILURES.field()
    #: trims that found a group past an id ahead of the server clock (a poisoned stream)
    future_ids: int = STREAM_FUTURE_IDS.field()
    #: result records past their window, removed by the trim
    results_purged: int = 0


class ReplyPublisher:
    """Publishes claimed outbox rows and records what that did, under one publisher
    identity (``owner``): the one publication path of the dispatcher and of workers that
    publish their own replies.

    ``publish`` runs the record script for a batch (one pipelined round trip; crash points
    ``dispatcher.before_xadd`` / ``dispatcher.after_xadd``); ``settle`` marks the
    confirmed rows sent (one transaction, each row fenced; then ``dispatcher.after_mark_sent``)
    and records the others (``settle_failures``): a content conflict is ``dead`` at once,
    a failure goes back in line with backoff (``dead`` past the budget). A caller that
    writes the marks in a transaction of its own uses ``confirmed`` and ``count_marked``
    around it instead of ``settle``'s mark step.

    Args:
        client: a client from ``redis.client.connect`` (no automatic re-sends).
        outbox: the outbox of this process's database.
        keys: the key layout.
        owner: the publisher's name on the rows it holds.
        keyring: signs every entry for the principal it is addressed to.
        record_ttl_s: how long a publication record dedupes its reply id.
        result_ttl_s: how long the result record of a terminal reply lives at most.
        stats: where outcomes are counted.
        logger: where dead replies and refusals are reported.
    """

    def __init__(
        self,
        client: Redis,
        outbox: OutboxStore,
        keys: Keys,
        owner: str,
        *,
        keyring: Keyring,
        record_ttl_s: float = DEFAULT_RECORD_TTL_S,
        result_ttl_s: float = DEFAULT_RESULT_TTL_S,
        stats: DispatcherStats | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.result_ttl_s = result_ttl_s
        self.client = client
        self.outbox = outbox
        self.keys = keys
        self.owner = owner
        self.keyring = keyring
        self.record_ttl_s = record_ttl_s
        self.stats = stats if stats is not None else DispatcherStats()
        self.log = logger or logging.getLogger("broker_adapter.stages.dispatcher")

    def publish(self, rows: list[OutboxRow]) -> list[Publication]:
        """Run the publication script for each row, all in one pipelined round trip.

        Never raises for Redis trouble: an unreachable server makes every row ``FAILED``
        (the outcome is ambiguous; the records make the retry safe). A row that cannot be
        signed (its principal has no key) is ``FAILED`` without reaching Redis.
        """
        started = tracing.now()
        pubs = self._publish(rows)
        tracing.published(rows, pubs, started)
        return pubs

    def _sign(self, row: OutboxRow, body: bytes, kid: str | None) -> ReplySignature:
        """Sign with the key the request came with (``kid``), so that a receiver that has not
        got a newer key yet still verifies the reply; with the principal's first key when
        the request had none (ACL mode, a conflict answer) or its key left the keyring.

        Raises:
            AuthError: the principal has no key at all.
        """
        if kid is not None:
            with contextlib.suppress(AuthError):  # rotated out: the current key below
                return self.keyring.sign_reply(row.principal, row.reply_id, body, kid)
        return self.keyring.sign_reply(row.principal, row.reply_id, body)

    def _publish(self, rows: list[OutboxRow]) -> list[Publication]:
        if not rows:
            return []
        crashpoints.hit("dispatcher.before_xadd")
        ttl_ms = max(1, int(self.record_ttl_s * 1000))
        result_ms = max(1, int(self.result_ttl_s * 1000))
        now_ms = int(self.outbox.clock.now() * 1000)
        pubs: list[Publication | None] = []
        signed: list[OutboxRow] = []
        calls: list[tuple[list[str], list[bytes | str | int]]] = []
        kids = self.outbox.request_kids([r.task_id for r in rows if r.task_id is not None])
        for r in rows:
            body = bytes(r.body)
            try:
                kid, sig = self._sign(r, body, kids.get(r.task_id or ""))
            except AuthError as exc:
                detail = f"cannot sign reply {r.reply_id} for {r.principal!r}: {exc}"
                pubs.append(Publication(r.reply_id, PublishOutcome.FAILED, None, detail))
                continue
            pubs.append(None)
            signed.append(r)
            keys = [self.keys.reply_record(r.principal, r.reply_id), self.keys.replies(r.principal)]
            args: list[bytes | str | int] = [
                r.content_hash,
                ttl_ms,
                r.reply_id,
                body,
                REPLY_WIRE_VERSION,
                kid,
                sig,
            ]
            if r.status != CONFLICT_STATUS:  # a request's own reply: its result record too
                keys += [
                    self.keys.reply_result(r.principal, r.message_id),
                    self.keys.reply_results(r.principal),
                ]
                args += [result_ms, now_ms, r.message_id]
            calls.append((keys, args))
        try:
            replies = eval_many(self.client, PUBLISH_SCRIPT, calls) if calls else []
        except RedisUnavailable as exc:
            failed = PublishOutcome.FAILED
            unreachable = (Publication(r.reply_id, failed, None, str(exc), True) for r in signed)
            return [pub or next(unreachable) for pub in pubs]
        crashpoints.hit("dispatcher.after_xadd")
        outcomes = (self._outcome(r, reply) for r, reply in zip(signed, replies, strict=True))
        return [pub or next(outcomes) for pub in pubs]

    def _outcome(self, row: OutboxRow, reply: Any) -> Publication:
        if isinstance(reply, BrokerAdapterError):
            transient = isinstance(reply, TransientError)
            return Publication(row.reply_id, PublishOutcome.FAILED, None, str(reply), transient)
        code, value = int(reply[0]), text(reply[1])
        if code == 0:
            return Publication(row.reply_id, PublishOutcome.PUBLISHED, value)
        if code == 1:
            return Publication(row.reply_id, PublishOutcome.ALREADY_PUBLISHED, value)
        detail = (
            f"reply_conflict: reply id {row.reply_id} was published with content hash "
            f"{value[:16]}, the outbox holds {row.content_hash[:16]}"
        )
        return Publication(row.reply_id, PublishOutcome.CONFLICT, None, detail)

    @staticmethod
    def confirmed(
        rows: list[OutboxRow], pubs: list[Publication]
    ) -> list[tuple[OutboxRow, Publication]]:
        """The rows Redis confirmed (published now or before), with their publication."""
        ok = (PublishOutcome.PUBLISHED, PublishOutcome.ALREADY_PUBLISHED)
        return [(row, pub) for row, pub in zip(rows, pubs, strict=True) if pub.outcome in ok]

    def count_marked(
        self, done: list[tuple[OutboxRow, Publication]], refused: list[StaleError | None]
    ) -> int:
        """Count what a mark-sent write did (``refused``: one entry per ``done`` row);
        returns how many rows were marked sent."""
        marked = 0
        for (row, pub), stale in zip(done, refused, strict=True):
            if stale is not None:
                self._fenced(row, stale)
                continue
            marked += 1
            if pub.outcome is PublishOutcome.PUBLISHED:
                self.stats.published += 1
            else:
                self.stats.already_published += 1
        return marked

    def settle(
        self, rows: list[OutboxRow], pubs: list[Publication], *, claim_next: int = 0
    ) -> tuple[int, list[OutboxRow]]:
        """Record what ``publish`` did: sent (one transaction), dead, or retry later. With
        ``claim_next`` the mark-sent transaction also claims up to that many rows.

        Returns:
            how many rows were marked sent, and the rows claimed.
        """
        done = self.confirmed(rows, pubs)
        refused, ahead = self.outbox.mark_sent_and_claim(
            self.owner,
            [(row.reply_id, row.fence, pub.entry_id or "") for row, pub in done],
            claim_next,
        )
        crashpoints.hit("dispatcher.after_mark_sent")
        marked = self.count_marked(done, refused)
        self.settle_failures(rows, pubs)
        return marked, ahead

    def settle_failures(self, rows: list[OutboxRow], pubs: list[Publication]) -> None:
        """Record the rows ``publish`` did not confirm: a conflict is ``dead`` at once, a
        failure goes back in line with backoff (``dead`` past the budget). Each its own
        short transaction, fenced; rows this publisher no longer holds are only counted."""
        owner = self.owner
        for row, pub in zip(rows, pubs, strict=True):
            try:
                if pub.outcome is PublishOutcome.CONFLICT:
                    self.stats.conflicts += 1
                    self.outbox.mark_dead(row.reply_id, owner, row.fence, pub.detail)
                    self.stats.dead += 1
                    self.log.error(
                        "reply %s is dead: %s",
                        row.reply_id,
                        pub.detail,
                        extra=transitions.reply_fields(row),
                    )
                elif pub.outcome is PublishOutcome.FAILED:
                    self.stats.failed += 1
                    state = self.outbox.retry(row.reply_id, owner, row.fence, pub.detail)
                    if state == "dead":
                        self.stats.dead += 1
                        self.log.error(
                            "reply %s is dead after %d attempts: %s",
                            row.reply_id,
                            row.attempts,
                            pub.detail,
                            extra=transitions.reply_fields(row),
                        )
            except StaleError as exc:
                self._fenced(row, exc)

    def _fenced(self, row: OutboxRow, exc: StaleError) -> None:
        self.stats.fenced += 1
        self.log.warning("reply %s: %s no longer holds it (%s)", row.reply_id, self.owner, exc)
