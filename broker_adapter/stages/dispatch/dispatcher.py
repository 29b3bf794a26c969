"""The reply dispatcher: outbox rows to the principal's reply stream, one entry per reply id.

Who publishes: a worker with a Redis client publishes the replies of its own batches right
after their commit (``worker.Worker``): its settle transaction writes them already claimed
by its publisher (``sending``, owner ``<worker>-pub``, a lease, fence 1), and it publishes
them with ``publish.ReplyPublisher``, the same code, script and crash points as the
dispatcher's. The dispatcher publishes everything else (conflict answers, expiries,
cancellations, replies of workers without Redis) and sweeps: a worker's row whose publisher
lease ran out (the worker died, or Redis failed it and it went back in line) is claimed and
published here like any other.

Invariants kept (``docs/RULES.md`` rules 13, 14): every reply is published under its stable reply id
with the bytes fixed in the outbox; the publisher holds each row under its own claim, lease
and fence; after the retry budget a row is ``dead`` with its last error, and the operator's
replay checks Redis by reply id first.

Publication is ``publish.ReplyPublisher``'s: one Lua script per reply, whose publication
record (kept ``record_window_s``) makes a second publication of a reply id add nothing and
refuses other content under it, and a signature made at publish time (a row that cannot be
signed is never published unsigned). A dispatcher built without a keyring (the operator's
replay) publishes nothing.

The scripts of a claimed batch are pipelined (one round trip) and the batch is marked sent
in one SQLite transaction (each row fenced on its own: a fenced-out row is refused before it
writes anything and does not sink the rest). In ``run`` that transaction also claims the next
batch (one fsync instead of two); rows claimed ahead are published by the next step, also
when a stop arrives in between. When idle, ``run`` looks at the outbox with a read
(``OutboxStore.has_ready``) every ``wake_poll_s`` for a second after its last publication,
then less and less often, up to ``idle_poll_s``.

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

Redis data loss (a wipe, a restart that lost acknowledged writes) is watched before each
batch by ``loss.LossWatch``; the operator's replay of a ``dead`` reply is ``replay.Replayer``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING

from pydantic import Field

from broker_adapter import crashpoints
from broker_adapter.clock import Clock
from broker_adapter.config import RETENTION_SETTING, ConfigModel
from broker_adapter.errors import (
    BrokerAdapterError,
    ConfigError,
    RedisUnavailable,
    TransientError,
)
from broker_adapter.protocol.deadletter import encodable
from broker_adapter.protocol.keys import PREFIX_SETTING, KeyPrefix, Keys
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.results import purge_results
from broker_adapter.redis.trimming import (
    DEFAULT_TRIM_EVERY_S,
    DEFAULT_TRIM_KEEP_S,
    trim_with_dead_letters,
)
from broker_adapter.redis.trimming import now_ms as trim_now_ms
from broker_adapter.stages.dispatch.loss import DEFAULT_LOSS_WINDOW_S, LossWatch, Watch
from broker_adapter.stages.dispatch.replay import Replayer, ReplayResult
from broker_adapter.stages.shared.loop import (
    DEFAULT_IDLE_POLL_S,
    DEFAULT_WAKE_POLL_S,
    IdlePolicy,
    look,
    run_stage,
)
from broker_adapter.stages.shared.publish import (
    DEFAULT_RECORD_TTL_S,
    DEFAULT_RESULT_TTL_S,
    DispatcherStats,
    Publication,
    ReplyPublisher,
)
from broker_adapter.store.outbox import OutboxStore
from broker_adapter.store.outbox_types import OutboxRow

if TYPE_CHECKING:
    from broker_adapter.redis.client import Redis

DEFAULT_DISPATCH_BATCH = 64
#: An idle dispatcher still runs a whole step (the data-loss watch included) this often.
IDLE_STEP_EVERY_S = 0.5


def default_owner() -> str:
    """A dispatcher name unique on this host, a logical id: ``dispatcher-<digest of the host
    name>-<pid>`` (an adapter passes one derived from its consumer name)."""
    host = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
    return f"dispatcher-{host}-{os.getpid()}"


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
        result_ttl_s: how long the result record of a request (its signed reply by message
            id, ``redis.results``) is kept, seconds (``result_window_s``: no longer than
            ``retention_s``); ``trim`` purges older ones.
    """

    prefix: KeyPrefix = PREFIX_SETTING
    owner: str = Field(default_factory=default_owner, min_length=1, max_length=200)
    batch: int = Field(default=DEFAULT_DISPATCH_BATCH, ge=1, le=10_000)
    record_ttl_s: float = Field(default=DEFAULT_RECORD_TTL_S, gt=0)
    idle_poll_s: float = Field(default=DEFAULT_IDLE_POLL_S, gt=0)
    wake_poll_s: float = Field(default=DEFAULT_WAKE_POLL_S, gt=0)
    loss_window_s: float = Field(default=DEFAULT_LOSS_WINDOW_S, ge=0)
    retention_s: float = RETENTION_SETTING
    trim_every_s: float = Field(default=DEFAULT_TRIM_EVERY_S, gt=0)
    trim_keep_s: float = Field(default=DEFAULT_TRIM_KEEP_S, ge=0)
    result_ttl_s: float = Field(default=DEFAULT_RESULT_TTL_S, gt=0)

    @property
    def result_window_s(self) -> float:
        """How long a result record lives: ``min(result_ttl_s, retention_s)``."""
        return min(self.result_ttl_s, self.retention_s)

    @property
    def record_window_s(self) -> float:
        """How long a publication record lives: ``min(record_ttl_s, retention_s)``."""
        return min(self.record_ttl_s, self.retention_s)


class Dispatcher:
    """Publishes outbox rows to the reply streams, at most one entry per reply id.

    Args:
        config: batch size, retention window, loss window.
        client: a client from ``redis.client.connect`` (no automatic re-sends).
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
        client: Redis,
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
        #: Rows claimed in the last batch's mark-sent transaction, published next (``run``).
        self._ahead: list[OutboxRow] = []
        self.loss = LossWatch(
            client,
            outbox,
            self.keys,
            loss_window_s=config.loss_window_s,
            clock=self.clock,
            stats=self.stats,
            logger=self.log,
        )
        self.replayer = Replayer(client, outbox, self.keys, self.log)
        self._publisher = (
            None
            if keyring is None
            else ReplyPublisher(
                client,
                outbox,
                self.keys,
                config.owner,
                keyring=keyring,
                record_ttl_s=config.record_window_s,
                result_ttl_s=config.result_ttl_s,
                stats=self.stats,
                logger=self.log,
            )
        )
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
        """Look for Redis data loss and put lost replies back in line (``LossWatch.watch``).

        Raises:
            RedisUnavailable: Redis could not be asked; nothing was changed.
        """
        return self.loss.watch()

    @property
    def redis_version(self) -> str | None:
        """The server's version, as the last look found it."""
        return self.loss.redis_version

    @property
    def idmp_supported(self) -> bool | None:
        """True when the server takes ``XADD ... IDMP`` (Redis >= 8.6); noted, not used."""
        return self.loss.idmp_supported

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
        """Call ``step`` until ``stop`` is set (``loop.run_stage``); back off (tenacity) on
        ``TransientError``.

        After a step that marked nothing sent it looks at the outbox (a read) every
        ``wake_poll_s`` for ``ALERT_AFTER_WORK_S`` after its last publication, then at
        doubling intervals up to ``idle_poll_s``, and steps again as soon as a row is ready,
        or after ``IDLE_STEP_EVERY_S`` in any case. Once stopped, rows claimed ahead are
        published (steps that claim nothing more) before it returns.
        """
        idle = IdlePolicy(self.config.wake_poll_s, self.config.idle_poll_s)
        stepped_at = time.monotonic()

        def step() -> bool:
            nonlocal stepped_at
            marked = self.step(claim_ahead=not stop.is_set())
            stepped_at = time.monotonic()
            if not (marked or self._ahead):
                return False
            idle.worked()
            return True

        def due() -> bool:
            return time.monotonic() - stepped_at >= IDLE_STEP_EVERY_S or look(
                self.outbox.has_ready, self.log, "looking at the outbox"
            )

        run_stage(
            stop,
            step,
            log=self.log,
            what="dispatcher",
            wait=lambda: idle.wait_for_work(stop.wait, due),
            pending=lambda: bool(self._ahead),
            drain=self.step,
        )

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
                self.client,
                stream,
                self.keys.replies_dead(principal),
                keep_from_ms=keep_from_ms,
                dead_before_ms=expire_ms,
                log=self.log,
                expire_before_ms=expire_ms,
            )
            if done is None:
                self.stats.trim_failures += 1
                continue
            result, dead = done
            self.stats.future_ids += bool(result.future_id)
            self.stats.results_purged += self._purge_results(
                principal, now_ms - cfg.result_window_s * 1000
            )
            if result.expired:
                self.log.warning(
                    "%s: %d replies no group acknowledged within the retention window "
                    "(%.0f s) trimmed (their outbox rows still hold them): %s",
                    stream,
                    len(result.expired),
                    cfg.retention_s,
                    ", ".join(encodable(r, 200) or f"<entry {e}>" for e, r in result.expired),
                )
            self.stats.trimmed += result.trimmed
            self.stats.unread_trimmed += len(result.expired)
            self.stats.dead_letters_trimmed += dead
            removed += result.trimmed + dead
        self._next_trim = self.clock.now() + cfg.trim_every_s
        crashpoints.hit("dispatcher.after_trim")
        return removed

    def _purge_results(self, principal: str, before_ms: float) -> int:
        """Purge ``principal``'s result records older than the result window; a refusal
        is logged as an alarm (like a failed trim) and tried again at the next trim."""
        try:
            return purge_results(
                self.client,
                self.keys.reply_results(principal),
                self.keys.reply_result(principal, ""),
                before_ms,
            )
        except TransientError:
            raise
        except BrokerAdapterError as exc:
            self.stats.trim_failures += 1
            self.log.error("ALARM: purging %s's result records failed: %s", principal, exc)
            return 0

    # -- operator path ------------------------------------------------------------------------

    def list_dead(self, limit: int = 1000) -> list[OutboxRow]:
        """Replies with no trusted confirmation, oldest first (``Replayer.list_dead``)."""
        return self.replayer.list_dead(limit)

    def replay(self, reply_id: str, by: str) -> ReplayResult:
        """Operator action on a ``dead`` reply, reconciled against Redis first
        (``Replayer.replay``)."""
        return self.replayer.replay(reply_id, by)
