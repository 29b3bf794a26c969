"""The idempotent receiver: each reply on a principal's reply stream applied exactly once.

Invariants kept (``docs/RULES.md`` rules 15, 16): replies are deduplicated by reply id with
a content hash check; the receipt and the caller's effect commit in ONE SQLite transaction;
a duplicate skips the effect and returns the earlier result; different content under a known
reply id is refused (dead-lettered with reason ``reply_conflict``) and its effect never
runs.

Reading goes through a ``consumer.GroupConsumer`` and its ``redis.reader.GroupReader``
(consumer group ``ba-receiver`` on ``replies(P)``): after start and after every error it
re-reads its own pending entries first, it takes over entries idle in a dead consumer's
list (XAUTOCLAIM, every ``take_over_interval_s``), it recreates a group Redis lost, and it
dead-letters deleted entries and entries past ``max_deliveries``.

Per batch: the reader refuses entries of more than ``max_entry_fields`` fields, of more than
``max_reply_bytes`` bytes (inside Redis) and with a repeated field name; then check each
entry (fields ``v``, ``reply_id``, ``hash``, ``body``, ``kid``, ``sig``; the signature
verifies with one of this principal's keys; SHA-256 of the body equals ``hash``; the body is
strict JSON nesting at most ``REPLY_MAX_DEPTH`` levels, names this reply id and principal,
and is younger than ``max_reply_age_s`` (else ``stale``); anything else is dead-lettered
with its reason, an exception while checking one entry as ``internal_error``), then
``receiver.before_commit``, one transaction with a savepoint per reply, ``after_commit``,
one XACK for the batch, ``after_xack``. Surviving a crash:

* killed before the commit: nothing was written; the entries are still pending and come
  back (own-pending replay on restart, or another consumer's takeover); applied once then;
* killed after the commit, before the XACK: the receipts exist, so the redelivered entries
  are duplicates: effect skipped, entries acknowledged;
* killed after the XACK: nothing left to do.

Forged replies. Any client that can write the reply stream can append entries to it, so
only a signature proves an entry came from the adapter: ``sig`` is an HMAC with a key of the
principal the reply is for (see ``protocol.signing``). An unsigned or badly signed entry is
dead-lettered (``missing_field``, ``unknown_key``, ``bad_signature``) before anything is
written for it: no receipt, so a forgery published ahead of the real reply under the real
reply id cannot take its place, and the real reply is still applied when it comes.

A rewind (``XGROUP SETID <stream> ba-receiver 0``), a Redis wipe that made the dispatcher
re-send everything, or a second entry under one reply id all end as duplicates: zero new
effects. An effect that raises leaves no trace of its reply (savepoint), the entry stays
pending and is retried through the own-pending replay until ``max_deliveries``, after which
it is dead-lettered with reason ``delivery_limit``. The replay waits ``failed_step_pause_s``
after a step whose effect failed (new entries are read and applied meanwhile), so that the
retries of a failing effect are spaced by that pause rather than spent at once.

Effects. The callback ``effect(conn, reply)`` (``reply``: the parsed body, a
``protocol.reply.Reply``) runs inside the receipt's transaction on the same connection: it
must be a quick local write to this database, with no network call. An effect that leaves
the transaction records an intent row keyed by ``effect_key(reply)`` instead, for a sender
that carries the key and the fence to a system that checks them (docs/API.md, "Receive
replies").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator

from broker_adapter.clock import Clock
from broker_adapter.config import RETENTION_SETTING, ConfigModel, derive
from broker_adapter.errors import (
    AuthError,
    ConfigError,
    GroupMissingError,
    TransientError,
)
from broker_adapter.metric_fields import Family
from broker_adapter.protocol.canonical import sha256_hex
from broker_adapter.protocol.keys import (
    PREFIX_SETTING,
    RECEIVER_GROUP,
    KeyPrefix,
    Keys,
    Principal,
)
from broker_adapter.protocol.reply import BadReply, Reply, load_body
from broker_adapter.protocol.signing import REPLY_WIRE_VERSION, Keyring
from broker_adapter.redis.client import text, translated
from broker_adapter.redis.entry import StreamEntry
from broker_adapter.redis.reader import GroupReader
from broker_adapter.redis.reader_config import (
    BLOCK_MS_SETTING,
    IDLE_MS_SETTING,
    MAX_COUNT,
    MAX_DELIVERIES_SETTING,
    MAX_ENTRY_FIELDS_SETTING,
    ReaderConfig,
)
from broker_adapter.stages.shared import tracing
from broker_adapter.stages.shared.consumer import (
    Checked,
    CrashPoints,
    GroupConsumer,
    check_block_timeout,
)
from broker_adapter.stages.shared.loop import run_stage
from broker_adapter.store.receipts import (
    AppliedItem,
    Effect,
    ReceiptItem,
    ReceiptOutcome,
    ReceiptStore,
)
from broker_adapter.store.retention import PurgeBatch, PurgeSchedule

if TYPE_CHECKING:
    import sqlite3

    from broker_adapter.redis.client import Redis

DEFAULT_REPLY_READ_COUNT = 64
DEFAULT_TAKE_OVER_INTERVAL_S = 30.0
#: A reply body is at most a result (the payload limits: 64 KiB canonical) and its metadata
#: (ids, an error text of at most 4,000 characters): about 100 KB with every character
#: escaped. A megabyte leaves room and still keeps a hostile entry from costing more.
DEFAULT_MAX_REPLY_BYTES = 1024 * 1024
DEFAULT_FAILED_STEP_PAUSE_S = 1.0
#: Receipts from this long before the oldest pending entry's id time are kept too: slack
#: for Redis's clock, which stamps entry ids, running ahead of the receiver's (the two are
#: assumed to agree within it).
PENDING_SLACK_S = 5.0
#: How long a step spends on the receipts' purge at most (when a pass is due).
PURGE_STEP_BUDGET_S = 0.02
#: By default a reply is accepted up to ``retention_s`` minus this much old (at most half
#: of ``retention_s``): slack for the adapter's clock, which stamps ``finished_at``,
#: running behind the receiver's.
REPLY_AGE_SLACK_S = 3600.0
REPLY_FORMAT_VERSION = REPLY_WIRE_VERSION.encode()
_HEX = frozenset("0123456789abcdef")
_RECEIVER_POINTS = CrashPoints(
    before_commit="receiver.before_commit",
    after_commit="receiver.after_commit",
    after_xack="receiver.after_xack",
)


class ReceiverConfig(ConfigModel):
    """How a ``Receiver`` reads one principal's replies.

    Attributes:
        prefix: the key prefix (see ``keys``).
        principal: whose reply stream to read.
        group: the consumer group.
        consumer: this receiver's stable name (reuse it across restarts: its pending
            entries come back to it first).
        count: entries per read (and per transaction).
        block_ms: how long a read of new entries blocks; the client's socket timeout must
            be longer.
        claim_min_idle_ms: entries idle this long in another consumer's list are taken over.
        max_deliveries: entries delivered more often go to the dead-letter stream.
        take_over_interval_s: how often a takeover scan starts, seconds.
        max_reply_bytes: entries larger than this (all field names and values) are
            dead-lettered as ``oversize`` before they are hashed or parsed.
        max_entry_fields: entries of more fields are dead-lettered as
            ``too_many_fields``; a dead letter copies at most this many fields.
        failed_step_pause_s: after a step in which an effect failed, how long the replay
            of this consumer's pending entries (the retry) waits, seconds.
        retention_s: how long a receipt is kept after its reply was applied (and while an
            entry of the group read at or after it is still pending): a reply redelivered
            within it is a duplicate. Keep it at least the adapter's ``retention_s``.
        max_reply_age_s: an older reply (``Reply.made_at``) is dead-lettered as ``stale``:
            its receipt may be gone, a replay would apply again. ``None``: ``retention_s``
            less ``REPLY_AGE_SLACK_S`` (at most half). Below ``retention_s``, above the
            adapter's ``reply_window_s`` (docs/OPERATIONS.md, "Reply windows").
    """

    prefix: KeyPrefix = PREFIX_SETTING
    principal: Principal
    group: str = Field(default=RECEIVER_GROUP, min_length=1)
    consumer: str = Field(default="receiver-1", min_length=1)
    count: int = Field(default=DEFAULT_REPLY_READ_COUNT, ge=1, le=MAX_COUNT)
    block_ms: int = BLOCK_MS_SETTING
    claim_min_idle_ms: int = IDLE_MS_SETTING
    max_deliveries: int = MAX_DELIVERIES_SETTING
    take_over_interval_s: float = Field(default=DEFAULT_TAKE_OVER_INTERVAL_S, gt=0)
    max_reply_bytes: int = Field(default=DEFAULT_MAX_REPLY_BYTES, ge=1024)
    max_entry_fields: int = MAX_ENTRY_FIELDS_SETTING
    failed_step_pause_s: float = Field(default=DEFAULT_FAILED_STEP_PAUSE_S, ge=0)
    retention_s: float = RETENTION_SETTING
    max_reply_age_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _age_within_retention(self) -> ReceiverConfig:
        if self.max_reply_age_s is not None and self.max_reply_age_s >= self.retention_s:
            raise ValueError("max_reply_age_s must be below retention_s")
        return self

    @property
    def reply_age_limit_s(self) -> float:
        """``max_reply_age_s``, or its default."""
        default = self.retention_s - min(REPLY_AGE_SLACK_S, self.retention_s / 2)
        return default if self.max_reply_age_s is None else self.max_reply_age_s


@dataclass(frozen=True)
class EffectKey:
    """What an effect that leaves the receipt's transaction must carry.

    Attributes:
        idempotency_key: stable across every resend of the reply; give it to the remote
            system (e.g. an ``Idempotency-Key`` header) so that it can refuse a repeat.
        reply_id: the reply's id.
        task_id: the task the reply answers (``None`` for a conflict answer).
        fence: the fencing token the task's result was committed under.
    """

    idempotency_key: str
    reply_id: str
    task_id: str | None
    fence: int | None


def effect_key(reply: Reply) -> EffectKey:
    """The idempotency key and fence of a reply, for effects outside the transaction."""
    return EffectKey(
        idempotency_key=reply.idempotency_key,
        reply_id=reply.reply_id,
        task_id=reply.task_id,
        fence=reply.fence,
    )


def record_effect(conn: sqlite3.Connection, reply: Reply) -> dict[str, Any]:
    """A minimal effect (the CLI's ``receive``): the receipt, which keeps the body, is the
    record. Writes nothing else; returns the reply's task id, status and idempotency key,
    kept as the receipt's ``effect_result``."""
    return {
        "task_id": reply.task_id,
        "status": reply.status,
        "idempotency_key": reply.idempotency_key,
    }


def check_signature(
    fields: Mapping[bytes, bytes], principal: str, reply_id: str, keyring: Keyring
) -> str:
    """Check that a reply entry is signed for ``principal`` (``Keyring.verify_reply``).

    Returns:
        the key id that verified.

    The entry's size and fields were screened by the reader (``GroupReader``).

    Raises:
        BadReply: ``missing_field`` (no ``kid`` or ``sig``: an unsigned entry),
            ``unknown_key`` (``kid`` is not one of the principal's key ids) or
            ``bad_signature``.
    """
    kid, sig = fields.get(b"kid"), fields.get(b"sig")
    if kid is None or sig is None:
        raise BadReply("missing_field", "unsigned reply: no 'kid' or no 'sig' field")
    try:
        return keyring.verify_reply(principal, reply_id, bytes(fields[b"body"]), kid, sig)
    except AuthError as exc:
        raise BadReply(exc.reason, exc.detail) from None


def parse_entry(
    fields: Mapping[bytes, bytes],
    principal: str,
    entry_id: str,
    *,
    keyring: Keyring,
    not_before: float | None = None,
) -> ReceiptItem:
    """Check one reply entry and turn it into a ``ReceiptItem``.

    The signature is checked before anything in the body is looked at, and before the
    entry can be recorded: an entry that fails here leaves no trace but its dead letter.

    Args:
        not_before: refuse a reply made (``Reply.made_at``) before this time (``None``:
            any age).

    Raises:
        BadReply: ``bad_reply`` (fields, version, body), ``missing_field``,
            ``unknown_key`` or ``bad_signature`` (see ``check_signature``), ``bad_hash``,
            ``wrong_principal`` or ``stale``.
    """
    missing = [f for f in (b"v", b"reply_id", b"hash", b"body") if f not in fields]
    if missing:
        names = ", ".join(text(m) for m in missing)
        raise BadReply("bad_reply", f"missing field(s): {names}")
    if fields[b"v"] != REPLY_FORMAT_VERSION:
        raise BadReply(
            "bad_reply",
            f"reply format version {text(fields[b'v'])!r} is not {text(REPLY_FORMAT_VERSION)!r}"
            " (version 1 replies were unsigned and are refused)",
        )
    reply_id, content_hash, body = text(fields[b"reply_id"]), text(fields[b"hash"]), fields[b"body"]
    if "\n" in reply_id:
        raise BadReply("bad_reply", "reply id holds a newline")
    check_signature(fields, principal, reply_id, keyring)
    if len(content_hash) != 64 or not set(content_hash) <= _HEX:
        raise BadReply("bad_hash", "hash is not a SHA-256 hex digest")
    actual = sha256_hex(body)
    if actual != content_hash:
        raise BadReply("bad_hash", f"body hashes to {actual[:16]}, entry says {content_hash[:16]}")
    decoded = load_body(body)
    if decoded.get("reply_id") != reply_id:
        named = decoded.get("reply_id")
        raise BadReply("bad_reply", f"body names reply {named!r}, not {reply_id!r}")
    if decoded.get("principal") != principal:
        raise BadReply(
            "wrong_principal", f"reply for {decoded.get('principal')!r} on {principal!r}'s stream"
        )
    reply = Reply.from_mapping(decoded)
    made = reply.made_at
    if not_before is not None and (made is None or made < not_before):
        when = "no time" if made is None else f"time {made:.3f}"
        raise BadReply("stale", f"reply made at {when}, before the window's {not_before:.3f}")
    return ReceiptItem(reply_id, content_hash, principal, bytes(body), entry_id, reply)


RECEIVER_REPLIES = Family(
    "ba_receiver_replies",
    "Replies the receiver handled, by outcome (applied: effect run; duplicate: skipped).",
)


@dataclass
class ReceiverStats:
    """Counters since start; each declares its metric (``metric_fields``)."""

    applied: int = RECEIVER_REPLIES.field(outcome="applied")
    duplicates: int = RECEIVER_REPLIES.field(outcome="duplicate")
    conflicts: int = RECEIVER_REPLIES.field(outcome="conflict")
    bad: int = RECEIVER_REPLIES.field(outcome="bad")
    effect_failures: int = RECEIVER_REPLIES.field(outcome="effect_failure")


class Receiver:
    """Applies the replies addressed to one principal, each exactly once.

    Args:
        config: which stream, group and consumer; batch and takeover limits.
        client: a client from ``redis.client.connect`` whose socket timeout exceeds ``block_ms``.
        receipts: the receiver's receipt store.
        effect: called once per new reply inside its receipt's transaction (see above).
        keyring: holds the principal's keys (the same keyring file as for requests);
            every reply must be signed with one of them.
        clock: time source for takeover scheduling (defaults to the receipts' clock).
        logger: where warnings go.

    Raises:
        ConfigError: the client's socket timeout would cut a blocking read short, or the
            keyring has no keys for the principal.
    """

    def __init__(
        self,
        config: ReceiverConfig,
        client: Redis,
        receipts: ReceiptStore,
        effect: Effect | None = None,
        *,
        keyring: Keyring,
        clock: Clock | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        if not keyring.key_ids(config.principal):
            raise ConfigError(
                f"keyring has no keys for principal {config.principal!r}: its replies"
                " cannot be verified"
            )
        check_block_timeout(client, config.block_ms)
        self.config = config
        self.client = client
        self.receipts = receipts
        self.effect = effect
        self.keyring = keyring
        self.clock = clock or receipts.clock
        self.log = logger or logging.getLogger("broker_adapter.stages.receiver")
        self.stats = ReceiverStats()
        keys = Keys(config.prefix)
        reader = GroupReader(
            client,
            keys.replies(config.principal),
            config.group,
            config.consumer,
            keys.replies_dead(config.principal),
            derive(ReaderConfig, config, max_entry_bytes=config.max_reply_bytes),
            self.log,
        )
        self._consumer = GroupConsumer(
            reader, _RECEIVER_POINTS, screen=self._screen, commit=self._apply, settle=self._settle
        )
        self._next_take_over = float("-inf")
        self._failed_last_step = False
        #: When the own-pending replay deferred after a failed step is due (clock time).
        self._replay_at: float | None = None
        # The receiver is its database's only writer: its batches need no pause between
        # them, only a bound on how long one step spends on them.
        self._purges = PurgeSchedule(self.clock, self.log, pause_s=0.0, pause_factor=0.0)

    def step(self, *, peek: bool = True) -> int:
        """Read one batch (own pending first after any error, then new entries, plus a
        takeover page when due), apply it, acknowledge it.

        Args:
            peek: read the next new entries in the round trip of this batch's XACK (after a
                whole batch that read is sent before the batch is applied:
                ``GroupReader.prefetch``); the next step handles them (``run`` ends with a
                step without it, so that a clean stop leaves nothing read and unhandled).

        Returns:
            how many entries were acknowledged (applied or duplicate).

        Raises:
            RedisUnavailable: Redis could not be reached; the next step replays own pending.
            StoreBusy, StoreError: the transaction failed; nothing was acknowledged.
        """
        if self._purges.due():  # old receipts, a few batches between reply batches
            self._purges.run_for(self._purge_batch, PURGE_STEP_BUDGET_S)
        due = self._replay_at
        if self._consumer.held is None and due is not None and self.clock.now() >= due:
            self._replay_at = None
            self.reader.replay()  # the pause is over: retry the failed entries
        self._failed_last_step = False
        acked = self._consumer.step(peek=peek, take_over=self._take_over_page).acked
        if self._failed_last_step:
            # The failed entries stay pending and come back with the own-pending replay,
            # after the pause (one pause for every failure until then).
            if self._replay_at is None:
                self._replay_at = self.clock.now() + self.config.failed_step_pause_s
            self.reader.defer_replay()
        return acked

    @property
    def reader(self) -> GroupReader:
        """The reader of this principal's reply stream."""
        return self._consumer.reader

    def _take_over_page(self) -> list[StreamEntry]:
        """A take-over page, when one is due (the batch read in the same step)."""
        now = self.clock.now()
        if now < self._next_take_over:
            return []
        entries = self._consumer.take_over()
        if self.reader.scan_complete:
            self._next_take_over = now + self.config.take_over_interval_s
        return entries

    def _purge_batch(self, after: int) -> PurgeBatch:
        """One batch of the receipts purge: receipts applied more than ``retention_s`` ago,
        and none from ``PENDING_SLACK_S`` before the oldest entry the group still has
        pending (a receipt committed before a crash, its entry never acknowledged, is all
        that makes the entry's redelivery a duplicate, however long the receiver was
        down). Looks at Redis before the transaction, never inside it."""
        cutoff = self.clock.now() - self.config.retention_s
        try:
            with translated():
                summary = self.client.xpending(self.reader.stream, self.config.group)
        except GroupMissingError:  # no group (yet, or Redis lost it): nothing pending
            summary = {}
        oldest = summary.get("min") if summary.get("pending") else None
        if oldest is not None:
            oldest_ms = int(text(oldest).partition("-")[0])
            cutoff = min(cutoff, oldest_ms / 1000 - PENDING_SLACK_S)
        return self.receipts.purge_batch(cutoff, after)

    def _screen(self, entries: list[StreamEntry]) -> Checked[ReceiptItem]:
        seen: set[str] = set()
        good: Checked[ReceiptItem] = Checked()
        not_before = self.clock.now() - self.config.reply_age_limit_s
        for entry in entries:
            if entry.entry_id in seen or entry.fields is None:
                continue
            seen.add(entry.entry_id)
            try:
                item = parse_entry(
                    entry.fields,
                    self.config.principal,
                    entry.entry_id,
                    keyring=self.keyring,
                    not_before=not_before,
                )
                good.add(entry, item)
            except BadReply as bad:
                self.stats.bad += 1
                self.reader.dead_letter(entry, bad.reason, bad.detail)
            except TransientError:
                raise  # not the entry's fault: the batch is replayed
            except Exception as exc:  # noqa: BLE001 - this entry's problem, not the batch's
                self.stats.bad += 1
                self.reader.dead_letter_exception(entry, exc, "checking it")
        return good

    def _apply(self, items: list[ReceiptItem]) -> list[AppliedItem]:
        """The batch's one transaction: a receipt and the effect per new reply."""
        return self.receipts.apply_many(items, self.effect)

    def _settle(
        self, batch: Checked[ReceiptItem], results: list[AppliedItem], started: int
    ) -> list[str]:
        tracing.received(batch.items, results, started)
        ack: list[str] = []
        for entry, result in zip(batch.entries, results, strict=True):
            if self._outcome(entry, result):
                ack.append(entry.entry_id)
        return ack

    def _outcome(self, entry: StreamEntry, result: AppliedItem) -> bool:
        """Count one reply's outcome; True when its entry is to be acknowledged."""
        if result.outcome is None:
            self.stats.effect_failures += 1
            self._failed_last_step = True
            self.log.warning(
                "effect for reply %s (entry %s) failed, will retry: %r",
                result.reply_id,
                entry.entry_id,
                result.error,
            )
            return False
        if result.outcome is ReceiptOutcome.CONFLICT:
            self.stats.conflicts += 1
            earlier = result.receipt.content_hash[:16] if result.receipt else "?"
            self.reader.dead_letter(
                entry,
                "reply_conflict",
                f"reply {result.reply_id} was applied with content hash {earlier}; "
                "this entry carries other content and is refused",
            )
            return False
        if result.outcome is ReceiptOutcome.DUPLICATE:
            self.stats.duplicates += 1
        else:
            self.stats.applied += 1
        return True

    def run(self, stop: threading.Event) -> None:
        """Call ``step`` until ``stop`` is set (``loop.run_stage``); back off (tenacity) on
        ``TransientError``; once stopped, steps without ``peek`` while entries read ahead
        wait, so that a clean stop leaves nothing read and unhandled.

        (A failing effect is retried after ``failed_step_pause_s``; ``step`` itself spaces
        the retries, and reads of new entries block for ``block_ms``, so nothing spins.)
        """
        run_stage(
            stop,
            self.step,
            log=self.log,
            what="receiver",
            pending=lambda: self.reader.has_ahead,
            drain=lambda: self.step(peek=False),
        )
