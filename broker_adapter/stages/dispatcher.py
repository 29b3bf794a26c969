"""The reply dispatcher: outbox rows to the principal's reply stream, one entry per reply id.

Who publishes: a worker with a Redis client publishes the replies of its own batches right
after their commit (``worker.Worker``): its settle transaction writes them already claimed
by its publisher (``sending``, owner ``<worker>-pub``, a lease, fence 1), and it publishes
them with this module's ``ReplyPublisher``, the same code, script and crash points as the
dispatcher's. The dispatcher publishes everything else (conflict answers, expiries,
cancellations, replies of workers without Redis) and sweeps: a worker's row whose publisher
lease ran out (the worker died, or Redis failed it and it went back in line) is claimed and
published here like any other.

Invariants kept (``docs/RULES.md`` rules 13, 14): every reply is published under its stable reply id
with the bytes fixed in the outbox; the publisher holds each row under its own claim, lease
and fence; after the retry budget a row is ``dead`` with its last error, and the operator's
replay checks Redis by reply id first.

Publication is idempotent in Redis itself. ONE Lua script on two keys of one hash tag,
``reply_record(P, reply_id)`` and ``replies(P)``, looks up the reply's publication record
(``"<content hash> <entry id>"``, kept ``record_window_s``) and XADDs only when there is
none:

* no record: XADD the entry (``v``, ``reply_id``, ``hash``, ``body``, ``kid``, ``sig``),
  record it (SET NX, TTL);
* record, same hash: already published, the earlier entry id is returned, nothing added;
* record, other hash: a permanent conflict; the row goes ``dead`` with the reason.

Every entry is signed for the principal it is addressed to (``auth.Keyring.sign_reply``:
``kid`` and ``sig``), at publish time: the HMAC is deterministic, so publishing a row again
gives the same entry and the outbox stores nothing about it; the record still dedupes by the
body's content hash (after a key rotation a re-publish is still "already published"). A row
whose principal has no key in the keyring cannot be signed: it fails like an unconfirmed
publication (retried with backoff, ``dead`` past the budget), and is never published
unsigned. A dispatcher built without a keyring (the operator's replay) publishes nothing.

The script's two writes reach the AOF as one MULTI/EXEC, so they survive or vanish together.
The scripts of a claimed batch are pipelined (one round trip) and the batch is marked sent
in one SQLite transaction (each row fenced on its own: a fenced-out row is refused before it
writes anything and does not sink the rest). In ``run`` that transaction also claims the next
batch (one fsync instead of two); rows claimed ahead are published by the next step, also
when a stop arrives in between. When idle, ``run`` looks at the outbox with a read
(``OutboxStore.has_ready``) every ``wake_poll_s`` for a second after its last publication,
then less and less often, up to ``idle_poll_s``.
Redis >= 8.6 has ``XADD ... IDMP`` (detected and logged); it keeps ids for at most a day and
does not compare content, so the script stays the path that also catches conflicts.

Publication records: who publishes a reply id a second time, and how long each path needs
the record (defaults: ``lease_s`` 30 s, 20 attempts, backoff up to 30 s):

* the worker publishes, dies (or loses Redis) before its mark; the dispatcher sweeps the row
  once the publisher lease runs out: ``lease_s`` plus one idle step (0.5 s);
* the dispatcher itself killed after the XADD, or its script reply lost: the row is claimed
  again after its lease, or retried with backoff: at most the retry budget, ``max_attempts``
  x (``lease_s`` + backoff cap) = 20 min if every attempt ends in a crash, ~8 min of
  backoff if Redis stays unreachable;
* the data-loss re-send after a restart seen while running: rows sent ``loss_window_s``
  before the last look (one ``IDLE_STEP_EVERY_S`` ago at most), and the recheck one
  ``lease_s`` after the alarm: under a minute. A restart found at start-up re-sends the rows
  sent around the server's start, which may be as old as the dispatcher's downtime; after a
  wipe there is no record to find anyway;
* the operator's replay of a ``dead`` row: whenever the operator acts (days).

So the record is kept ``record_window_s = min(record_ttl_s, retention_s)``, 30 minutes by
default (above the 20-minute budget); its footprint is rate x 30 min (~150 bytes a reply),
not a key per reply for a week. The paths that can come later than that use the stream
itself: the replay, when no record is left, searches the reply stream from shortly before
the row was written (``_find_in_stream``: bounded, the streams are trimmed to what their
groups have not acknowledged). A re-send that finds neither record nor entry appends a new
entry under the same reply id: the earlier one was read by every group and trimmed (the
receivers' receipts dedupe it), or expired unread after the retention window (the point of
publishing it again). The guarantee within the window is unchanged: a second publication
adds no entry, other content under the id is a conflict.

Trimming (``trim``, every ``trim_every_s`` from ``step``; ``trimming``). The dispatcher owns
the reply streams of every principal of its keyring. Each is cut up to the oldest entry any
group on it has not been delivered or still has pending; acknowledged replies younger than
``min(trim_keep_s, retention_s)`` stay; a reply no group acknowledged (a receiver down, or
no group yet) stays for ``retention_s``, then is trimmed, counted (``unread_trimmed``) and
logged with its reply id: its outbox row still holds it until the row's own retention.
Reply dead letters (``{out.P}:dead``, written by receivers) go by age, ``retention_s``.

Crash order is XADD, then mark sent (the reverse could lose a reply):

* killed before the XADD (``dispatcher.before_xadd``): the row stays ``sending`` until its
  lease runs out, then is claimed again and published;
* killed after the XADD, before the mark (``dispatcher.after_xadd``): reclaimed later, the
  script finds the record and returns the same entry id; no second entry;
* killed after the mark (``dispatcher.after_mark_sent``): nothing left to do;
* reply of the script lost (connection cut after the server ran it): the failure is
  ambiguous, the row is retried, the record makes the retry return the same entry id.

A stale dispatcher (lease expired, another one claimed with fence+1) is refused at the
mark; what it published is the same entry the new holder gets back from the record.

Redis data loss (``docs/RULES.md``, "What Redis may lose"). Before each batch the dispatcher reads
the epoch key (``{p}:{meta}:epoch``, set once with NX to a random value) and
``INFO server``:

* epoch key gone or changed (a wipe, FLUSHALL, a new server): ALARM, every ``sent`` row is
  put back in line (which replies a receiver saw we cannot know; its receipts dedupe them),
  a new epoch is set. At start-up, a missing epoch key with ``sent`` rows in the outbox is
  the same alarm.
* only ``run_id`` changed (a restart): with ``appendfsync everysec`` the last ~1 s, at worst
  ~2 s, of acknowledged writes can be gone, so rows sent from ``loss_window_s`` before the
  last look at the old server onwards are put back. At start-up (no earlier look) the
  server's start time (now - ``uptime_in_seconds``) stands in: rows sent within
  ``loss_window_s`` before the last send that preceded it are put back. Records that did
  survive make those resends no-ops. With ``appendfsync always`` nothing is lost and the
  resends only cost a script call each. Set ``maxmemory-policy noeviction``: an evicted
  epoch key reads as a wipe.
* INFO refused (a Redis user without ``+info``, a server without INFO): restarts go
  unseen, only the epoch key is watched; the dispatcher logs that once, as a warning.

A worker marks its publications sent in a transaction of its own, so a mark can commit after
the alarm's requeue and leave a lost reply ``sent``. After each alarm the dispatcher puts
back the rows of the lost window confirmed before the alarm once more, ``RECHECK_AFTER_S``
later and again when every publisher lease held at the alarm has run out (a worker's mark is
refused after its lease). A worker must not mark its first publications before the
dispatcher's first look (a ``sent`` row with no epoch key reads as a wipe): the runner starts
the workers after it.

The epoch a dispatcher saw is kept in memory only. With one outbox database per Redis that
is enough (a missing key at start-up is the alarm); where several databases share a Redis,
a dispatcher that was down during a wipe and starts after another one set a new epoch
misses the alarm: after a known wipe, have the operator run ``OutboxStore.requeue_sent(None)``
on every such database (persisting the last epoch seen would close this gap; it needs a
schema migration).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from typing import TYPE_CHECKING, Any

import tenacity
from pydantic import Field

from broker_adapter import crashpoints
from broker_adapter.clock import Clock
from broker_adapter.config import ConfigModel, KeyPrefix
from broker_adapter.errors import (
    AuthError,
    BrokerAdapterError,
    ConfigError,
    RedisUnavailable,
    ReplyConflict,
    StaleError,
    TransientError,
)
from broker_adapter.protocol.keys import DEFAULT_PREFIX, Keys
from broker_adapter.protocol.signing import REPLY_WIRE_VERSION, Keyring
from broker_adapter.redis.streams import call, encodable, eval_many, retrying, text, translated
from broker_adapter.redis.trimming import (
    DEFAULT_TRIM_EVERY_S,
    DEFAULT_TRIM_KEEP_S,
    time_id,
    trim_with_dead_letters,
)
from broker_adapter.redis.trimming import now_ms as trim_now_ms
from broker_adapter.store import transitions
from broker_adapter.store.outbox import OutboxRow, OutboxStore, UnknownReply
from broker_adapter.store.retention import DEFAULT_RETENTION_S

if TYPE_CHECKING:
    import redis

DEFAULT_BATCH = 64
#: How long a publication record dedupes its reply id (see "Publication records" above).
DEFAULT_RECORD_TTL_S = 1800.0
#: The operator's replay looks for a reply in its stream from this long before the row was
#: written (entry ids carry the server's clock, ``created_at`` this process's).
REPLAY_SCAN_SKEW_S = 60.0
#: ... through at most this many entries, in pages of ``REPLAY_SCAN_PAGE``.
REPLAY_SCAN_MAX_ENTRIES = 100_000
REPLAY_SCAN_PAGE = 1000
DEFAULT_IDLE_POLL_S = 0.05
DEFAULT_WAKE_POLL_S = 0.001
#: An idle dispatcher still runs a whole step (the data-loss watch included) this often.
IDLE_STEP_EVERY_S = 0.5
#: After its last publication the dispatcher keeps looking every ``wake_poll_s`` this long.
ALERT_AFTER_WORK_S = 1.0
DEFAULT_LOSS_WINDOW_S = 2.0
#: After a data loss, the sent rows of the lost window are looked at again this long after
#: the alarm, and once more when every publisher lease then held has run out (see
#: ``Dispatcher.watch``: a worker's mark-sent can commit after the alarm).
RECHECK_AFTER_S = 1.0
REPLY_FORMAT_VERSION = REPLY_WIRE_VERSION
IDMP_MIN_VERSION = (8, 6)

# KEYS[1] publication record, KEYS[2] reply stream (same hash tag).
# ARGV[1] content hash, ARGV[2] record TTL ms, ARGV[3] reply id, ARGV[4] body bytes,
# ARGV[5] entry format version, ARGV[6] key id, ARGV[7] signature.
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
return {0, eid}
"""


def default_owner() -> str:
    """A dispatcher name unique on this host: ``dispatcher-<host>-<pid>``."""
    return f"dispatcher-{socket.gethostname()}-{os.getpid()}"


class DispatcherConfig(ConfigModel):
    """How a ``Dispatcher`` publishes.

    Attributes:
        prefix: the key prefix (see ``keys``).
        owner: this dispatcher's name on the outbox rows it claims.
        batch: rows claimed, published (one pipeline) and marked (one transaction) at once.
        record_ttl_s: how long a publication record dedupes its reply id at most, seconds
            (``record_window_s``: no longer than ``retention_s``). Past it a resend finds
            the reply in its stream (the replay) or appends a second entry (the receivers'
            receipts dedupe it).
        idle_poll_s: the longest pause between two looks at the outbox when it had nothing
            ready, seconds. A look is a read (``OutboxStore.has_ready``: no write lock, no
            fsync); a step follows when it finds a row, and every ``IDLE_STEP_EVERY_S``.
        wake_poll_s: the pause between looks for ``ALERT_AFTER_WORK_S`` after the last
            publication, seconds; then it doubles with every empty look, up to
            ``idle_poll_s``.
        loss_window_s: how far back a Redis restart can have lost acknowledged writes,
            seconds (``appendfsync everysec``: 1 s nominal, 2 s worst case).
        retention_s: the retention window, seconds: a reply no group has acknowledged is
            trimmed from its stream (counted and logged) once it is this old, a reply dead
            letter too; publication records live ``min(record_ttl_s, retention_s)``.
        trim_every_s: how often ``run`` trims the reply and reply dead-letter streams.
        trim_keep_s: acknowledged replies younger than this (or than ``retention_s``, if
            shorter) are kept, seconds.
    """

    prefix: KeyPrefix = DEFAULT_PREFIX
    owner: str = Field(default_factory=default_owner, min_length=1, max_length=200)
    batch: int = Field(default=DEFAULT_BATCH, ge=1, le=10_000)
    record_ttl_s: float = Field(default=DEFAULT_RECORD_TTL_S, gt=0)
    idle_poll_s: float = Field(default=DEFAULT_IDLE_POLL_S, gt=0)
    wake_poll_s: float = Field(default=DEFAULT_WAKE_POLL_S, gt=0)
    loss_window_s: float = Field(default=DEFAULT_LOSS_WINDOW_S, ge=0)
    retention_s: float = Field(default=DEFAULT_RETENTION_S, gt=0)
    trim_every_s: float = Field(default=DEFAULT_TRIM_EVERY_S, gt=0)
    trim_keep_s: float = Field(default=DEFAULT_TRIM_KEEP_S, ge=0)

    @property
    def record_window_s(self) -> float:
        """How long a publication record lives: ``min(record_ttl_s, retention_s)``."""
        return min(self.record_ttl_s, self.retention_s)


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


class ReplayOutcome(StrEnum):
    ALREADY_PUBLISHED = "already_published"  # Redis has it: marked sent, nothing re-sent
    REQUEUED = "requeued"  # back in line under the same reply id


@dataclass(frozen=True)
class ReplayResult:
    reply_id: str
    outcome: ReplayOutcome
    entry_id: str | None = None


class LossEvent(StrEnum):
    NONE = "none"
    WIPE = "wipe"
    RESTART = "restart"


@dataclass(frozen=True)
class Watch:
    """What one look at the server found, and how many rows it put back in line."""

    event: LossEvent
    epoch: str
    run_id: str
    requeued: int = 0


@dataclass
class _Recheck:
    """A later look for rows of a lost window that were marked sent after the alarm."""

    since: float | None
    until: float
    due: list[float]


@dataclass
class DispatcherStats:
    published: int = 0
    already_published: int = 0
    conflicts: int = 0
    failed: int = 0
    dead: int = 0
    fenced: int = 0
    wipes: int = 0
    restarts: int = 0
    requeued: int = 0
    trimmed: int = 0
    unread_trimmed: int = 0
    dead_letters_trimmed: int = 0
    trim_failures: int = 0


def parse_version(version: str) -> tuple[int, ...]:
    """``"7.0.15"`` -> ``(7, 0, 15)``; unparsable parts count as 0."""
    parts: list[int] = []
    for piece in version.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _parse_record(raw: bytes | str) -> tuple[str, str | None]:
    stored, _, entry_id = text(raw).partition(" ")
    return stored, entry_id or None


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
        client: a client from ``streams.connect`` (no automatic re-sends).
        outbox: the outbox of this process's database.
        keys: the key layout.
        owner: the publisher's name on the rows it holds.
        keyring: signs every entry for the principal it is addressed to.
        record_ttl_s: how long a publication record dedupes its reply id.
        stats: where outcomes are counted.
        logger: where dead replies and refusals are reported.
    """

    def __init__(
        self,
        client: redis.Redis,
        outbox: OutboxStore,
        keys: Keys,
        owner: str,
        *,
        keyring: Keyring,
        record_ttl_s: float = DEFAULT_RECORD_TTL_S,
        stats: DispatcherStats | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
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
        if not rows:
            return []
        crashpoints.hit("dispatcher.before_xadd")
        ttl_ms = max(1, int(self.record_ttl_s * 1000))
        pubs: list[Publication | None] = []
        signed: list[OutboxRow] = []
        calls: list[tuple[list[str], list[bytes | str | int]]] = []
        for r in rows:
            body = bytes(r.body)
            try:
                kid, sig = self.keyring.sign_reply(r.principal, r.reply_id, body)
            except AuthError as exc:
                detail = f"cannot sign reply {r.reply_id} for {r.principal!r}: {exc}"
                pubs.append(Publication(r.reply_id, PublishOutcome.FAILED, None, detail))
                continue
            pubs.append(None)
            signed.append(r)
            calls.append((
                [self.keys.reply_record(r.principal, r.reply_id), self.keys.replies(r.principal)],
                [r.content_hash, ttl_ms, r.reply_id, body, REPLY_FORMAT_VERSION, kid, sig],
            ))  # fmt: skip
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
            self.owner, [(row.reply_id, row.fence, pub.entry_id or "") for row, pub in done],
            claim_next,
        )  # fmt: skip
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
                    self.log.error("reply %s is dead: %s", row.reply_id, pub.detail,
                                   extra=transitions.reply_fields(row))  # fmt: skip
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


class Dispatcher:
    """Publishes outbox rows to the reply streams, at most one entry per reply id.

    Args:
        config: batch size, retention window, loss window.
        client: a client from ``streams.connect`` (no automatic re-sends).
        outbox: the outbox of this process's database.
        keyring: signs the replies (``ReplyPublisher``). Without one the dispatcher only
            watches, lists and replays (the operator's ``dead-letters replay``, which puts
            a row back in line for a running dispatcher): ``publish`` and ``step`` refuse.
        clock: time source (defaults to the outbox's clock).
        logger: where alarms go.
    """

    def __init__(
        self,
        config: DispatcherConfig,
        client: redis.Redis,
        outbox: OutboxStore,
        *,
        keyring: Keyring | None = None,
        clock: Clock | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.config = config
        self.client = client
        self.outbox = outbox
        self.clock = clock or outbox.clock
        self.keys = Keys(config.prefix)
        self.log = logger or logging.getLogger("broker_adapter.stages.dispatcher")
        self.stats = DispatcherStats()
        self.redis_version: str | None = None
        #: True when the server takes ``XADD ... IDMP`` (Redis >= 8.6); noted, not used.
        self.idmp_supported: bool | None = None
        self._epoch: str | None = None
        self._run_id: str | None = None
        #: Set once INFO failed and that was logged (it is said once, not at every look).
        self._info_refused = False
        #: Rows claimed in the last batch's mark-sent transaction, published next (``run``).
        self._ahead: list[OutboxRow] = []
        self._last_ok_at: float | None = None
        self._rechecks: list[_Recheck] = []
        self._publisher = None if keyring is None else ReplyPublisher(
            client, outbox, self.keys, config.owner, keyring=keyring,
            record_ttl_s=config.record_window_s, stats=self.stats, logger=self.log,
        )  # fmt: skip
        self._keyring = keyring
        self._next_trim = self.clock.now() + config.trim_every_s

    @property
    def publisher(self) -> ReplyPublisher:
        """The publication path (signing with the keyring).

        Raises:
            ConfigError: this dispatcher was built without a keyring.
        """
        if self._publisher is None:
            raise ConfigError("this dispatcher has no keyring: it cannot sign replies to publish")
        return self._publisher

    # -- loss detection ---------------------------------------------------------------------

    def watch(self) -> Watch:
        """Look for Redis data loss (epoch key, ``run_id``) and put lost replies back in line.

        Returns:
            what was found and how many rows were put back.

        Raises:
            RedisUnavailable: Redis could not be asked; nothing was changed.
        """
        now = self.clock.now()
        epoch_key = self.keys.epoch()
        with translated():
            pipe = self.client.pipeline(transaction=False)
            pipe.get(epoch_key)
            pipe.info("server")
            raw_epoch, info = pipe.execute(raise_on_error=False)
        if isinstance(raw_epoch, Exception):
            with translated():
                raise raw_epoch
        if isinstance(info, Exception):
            # Refused by an ACL without +info, or a server without INFO (an embedded fake):
            # only the epoch key can be watched.
            self._note_info_refused(info)
            info = {}
        epoch = None if raw_epoch is None else text(raw_epoch)
        run_id = str(info.get("run_id", ""))
        uptime_s = float(info.get("uptime_in_seconds", 0))
        self._note_version(str(info.get("redis_version", "0")))
        event, requeued = LossEvent.NONE, 0
        rechecked = self._recheck(now)
        if self._epoch is None:  # first look since this dispatcher started
            if epoch is None and self.outbox.counts()["sent"] > 0:
                event, requeued = LossEvent.WIPE, self._requeue_all("epoch key missing at start")
            elif epoch is not None:
                requeued = self.outbox.requeue_sent_near(now - uptime_s, self.config.loss_window_s)
                if requeued:
                    self.log.info(
                        "start-up: %d replies sent around the Redis start (%.0f s ago) put back"
                        " in line; surviving records make their resends no-ops",
                        requeued,
                        uptime_s,
                    )
        elif epoch != self._epoch:
            event, requeued = LossEvent.WIPE, self._requeue_all("epoch key gone or changed")
            self._schedule_recheck(None, now)
        elif run_id != self._run_id:
            event = LossEvent.RESTART
            last_ok = self._last_ok_at if self._last_ok_at is not None else now
            since = last_ok - self.config.loss_window_s
            requeued = self.outbox.requeue_sent(since)
            self._schedule_recheck(since, now)
            self.stats.restarts += 1
            self.log.warning(
                "Redis restarted (run_id %s -> %s): %d replies sent in its last %.1f s put back"
                " in line (appendfsync everysec may have lost them)",
                self._run_id,
                run_id,
                requeued,
                self.config.loss_window_s,
            )
        if epoch is None:
            epoch = self._set_epoch()
        requeued += rechecked
        self.stats.requeued += requeued
        self._epoch, self._run_id, self._last_ok_at = epoch, run_id, now
        return Watch(event, epoch, run_id, requeued)

    def _note_info_refused(self, error: Exception) -> None:
        """Say, once, that INFO failed: without the server's ``run_id`` and uptime a
        restart is not seen (only a wipe, by the epoch key)."""
        if self._info_refused:
            return
        self._info_refused = True
        self.log.warning(
            "Redis refused INFO (%s): Redis restarts go unnoticed, so replies a restart lost"
            " (appendfsync everysec) are not re-published; only a wipe (the epoch key) is"
            " detected. Grant the adapter's Redis user +info (its ACL line in"
            " docs/PROTOCOL.md section 9)",
            error,
        )

    def _schedule_recheck(self, since: float | None, now: float) -> None:
        """A worker that publishes its own replies marks them sent in a transaction of its
        own, possibly after this alarm's requeue: a reply it published to the server that
        lost its data would stay ``sent``. Its mark commits while its publisher lease holds,
        so rows confirmed (``sent_at``) up to now that show up ``sent`` later are put back
        in line again: soon, and when every lease held now has run out."""
        lease_s = self.outbox.policy.lease_s
        self._rechecks.append(_Recheck(since, now, [now + RECHECK_AFTER_S, now + lease_s]))

    def _recheck(self, now: float) -> int:
        """Run the rechecks that are due; returns how many rows they put back."""
        requeued = 0
        for check in list(self._rechecks):
            if check.due[0] > now:
                continue
            while check.due and check.due[0] <= now:
                check.due.pop(0)
            n = self.outbox.requeue_sent(check.since, check.until)
            if n:
                self.log.warning(
                    "%d replies published before the Redis data loss were marked sent after"
                    " it: put back in line",
                    n,
                )
            requeued += n
            if not check.due:
                self._rechecks.remove(check)
        return requeued

    def _requeue_all(self, why: str) -> int:
        n = self.outbox.requeue_sent(None)
        self.stats.wipes += 1
        self.log.error(
            "ALARM: Redis lost its data (%s): %d sent replies put back in line to be published"
            " again; receivers dedupe them by reply id",
            why,
            n,
        )
        return n

    def _set_epoch(self) -> str:
        key = self.keys.epoch()
        with translated():
            pipe = self.client.pipeline(transaction=False)
            pipe.set(key, secrets.token_hex(16), nx=True)
            pipe.get(key)
            _, raw = pipe.execute()
        return text(raw)

    def _note_version(self, version: str) -> None:
        if version == self.redis_version:
            return
        self.redis_version = version
        self.idmp_supported = parse_version(version)[:2] >= IDMP_MIN_VERSION
        self.log.info(
            "Redis %s: XADD IDMP %s; publishing through the record script (content checked)",
            version,
            "available" if self.idmp_supported else "not available",
        )

    # -- publishing ---------------------------------------------------------------------------

    def claim(self) -> list[OutboxRow]:
        """Claim up to ``batch`` ready rows (lease, attempts+1, fence+1).

        Raises:
            ConfigError: no keyring (nothing is claimed that could not be published).
        """
        publisher = self.publisher
        return self.outbox.claim(publisher.owner, self.config.batch)

    def publish(self, rows: list[OutboxRow]) -> list[Publication]:
        """Run the publication script for each row (``ReplyPublisher.publish``)."""
        return self.publisher.publish(rows)

    def settle(self, rows: list[OutboxRow], pubs: list[Publication], *, claim_next: int = 0) -> int:
        """Record what ``publish`` did: sent (one transaction), dead, or retry later. With
        ``claim_next`` the mark-sent transaction also claims up to that many rows for the
        next step (one fsync instead of two).

        Rows this dispatcher no longer holds (lease expired, fence moved on) are refused by
        the store and only counted in ``stats.fenced``: their new holder settles them.

        Returns:
            how many rows were marked sent.
        """
        marked, self._ahead = self.publisher.settle(rows, pubs, claim_next=claim_next)
        return marked

    def step(self, *, claim_ahead: bool = False) -> int:
        """Watch for data loss, then claim, publish and settle one batch.

        Args:
            claim_ahead: let the settling transaction claim the next batch too (``run``);
                the next step publishes it instead of claiming.

        Returns:
            how many replies were marked sent.

        Raises:
            RedisUnavailable: Redis could not be reached or was busy (the rows concerned
                were put back in line with backoff first).
            StoreBusy: SQLite stayed locked; claimed rows return when their lease runs out.
        """
        self.watch()
        if self.clock.now() >= self._next_trim:
            self.trim()
        rows, self._ahead = self._ahead or self.claim(), []
        if not rows:
            return 0
        pubs = self.publish(rows)
        unreachable = [p for p in pubs if p.transient]
        ahead = self.config.batch if claim_ahead and not unreachable else 0
        marked = self.settle(rows, pubs, claim_next=ahead)
        if unreachable:  # rows are back in line; let the caller back off
            raise RedisUnavailable(
                f"{len(unreachable)} of {len(pubs)} replies not confirmed: {unreachable[0].detail}"
            )
        return marked

    def run(self, stop: threading.Event) -> None:
        """Call ``step`` until ``stop`` is set; back off (tenacity) on ``TransientError``.

        After a step that marked nothing sent it looks at the outbox (a read) every
        ``wake_poll_s`` for ``ALERT_AFTER_WORK_S`` after its last publication, then at
        doubling intervals up to ``idle_poll_s``, and steps again as soon as a row is ready,
        or after ``IDLE_STEP_EVERY_S`` in any case.
        """
        policy = retrying().copy(stop=tenacity.stop_when_event_set(stop), sleep=stop.wait)
        pause = self.config.wake_poll_s
        busy_at = time.monotonic()
        while not stop.is_set() or self._ahead:  # rows claimed ahead are published first
            try:
                marked = policy(lambda: self.step(claim_ahead=not stop.is_set()))
            except TransientError:
                if stop.is_set():
                    return
                raise
            stepped_at = time.monotonic()
            if marked or self._ahead:
                busy_at = stepped_at
                pause = self.config.wake_poll_s
                continue
            while not stop.wait(pause):
                if time.monotonic() - busy_at >= ALERT_AFTER_WORK_S:
                    pause = min(pause * 2, self.config.idle_poll_s)
                if time.monotonic() - stepped_at >= IDLE_STEP_EVERY_S:
                    break
                try:
                    if self.outbox.has_ready():
                        break
                except TransientError as exc:
                    self.log.warning("looking at the outbox failed, will retry: %s", exc)

    # -- trimming -----------------------------------------------------------------------------

    def trim(self) -> int:
        """Trim the reply stream of every principal of the keyring (the streams this adapter
        writes) up to the oldest entry a group on it still needs (``trimming``): replies
        every group acknowledged go once ``min(trim_keep_s, retention_s)`` old, replies no
        group acknowledged once ``retention_s`` old (counted, and logged with their reply
        ids: the outbox row still holds each); reply dead letters go by age.

        Returns:
            how many entries were removed, dead letters included.

        Raises:
            TransientError: Redis could not be reached; the next step tries again.
        """
        if self._keyring is None:
            return 0
        cfg = self.config
        now_ms = trim_now_ms(self.client, self.clock)
        keep_from_ms = now_ms - min(cfg.trim_keep_s, cfg.retention_s) * 1000
        expire_ms = now_ms - cfg.retention_s * 1000
        removed = 0
        for principal in self._keyring.principals:
            stream = self.keys.replies(principal)
            done = trim_with_dead_letters(
                self.client, stream, self.keys.replies_dead(principal), keep_from_ms=keep_from_ms,
                dead_before_ms=expire_ms, log=self.log, expire_before_ms=expire_ms,
            )  # fmt: skip
            if done is None:
                self.stats.trim_failures += 1
                continue
            result, dead = done
            if result.expired:
                self.log.warning(
                    "%s: %d replies no group acknowledged within the retention window "
                    "(%.0f s) trimmed (their outbox rows still hold them): %s",
                    stream, len(result.expired), cfg.retention_s,
                    ", ".join(encodable(r, 200) or f"<entry {e}>" for e, r in result.expired),
                )  # fmt: skip
            self.stats.trimmed += result.trimmed
            self.stats.unread_trimmed += len(result.expired)
            self.stats.dead_letters_trimmed += dead
            removed += result.trimmed + dead
        self._next_trim = self.clock.now() + cfg.trim_every_s
        crashpoints.hit("dispatcher.after_trim")
        return removed

    # -- operator path ------------------------------------------------------------------------

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
            row.reply_id, seen, stream,
        )  # fmt: skip
        return None
