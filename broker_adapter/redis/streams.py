"""The only module that talks to Redis: client setup, error translation, and the one
consumer-group reader that ingest and the receiver share.

Delivery discipline (``GroupReader``):

* The group is created from ``0`` with MKSTREAM (never ``$``, which would skip entries
  published before the group existed); BUSYGROUP means it exists, which is fine.
* On start and after EVERY error, the reader first re-reads its own pending entries
  (``XREADGROUP ... 0``) until none are left, then switches to new ones (``>``) with BLOCK
  and COUNT. An XREADGROUP whose reply was lost left its entries in this consumer's pending
  list; this is what recovers them.
* A missing group (Redis lost its data) is recreated from ``0``, logged as an alarm, and
  reading carries on.
* Reading ahead is allowed only into this consumer's own pending list: a peeking ``ack``
  reads the next batch in its round trip, and after a whole batch ``prefetch`` sends the
  next read at once, so that Redis prepares it while the batch is checked and committed.
  What was read ahead and not yet handled is dropped on any error and comes back with the
  replay.
* ``take_over`` runs XAUTOCLAIM with a carried cursor until it comes back to ``0-0``, so
  every idle entry of a dead consumer is eventually examined, not just the first page.
* Entries are read as Redis keeps them, a list of name/value pairs (redis-py's callbacks
  would fold them into a dict, where a repeated name silently keeps its last value). The
  reader refuses, before anyone parses them: entries whose payload was deleted or trimmed
  (nil fields, or XAUTOCLAIM's deleted list), entries delivered more than
  ``max_deliveries`` times, entries of more than ``max_entry_fields`` fields
  (``too_many_fields``) or ``max_entry_bytes`` bytes (``oversize``), and entries that
  repeat a field name (``duplicate_field``). Each is moved to the dead-letter stream with
  its reason and acknowledged in ONE Lua script (atomic, even across an AOF tail loss), so
  it is neither looped on nor silently dropped.
* A dead letter copies the original pairs, in order and byte for byte, up to those two
  limits; of a larger entry it copies what fits and says so in ``dl.truncated`` (the entry
  itself stays in its stream under ``dl.entry_id`` until the stream's trim passes it:
  acknowledged entries are kept ``min(trim_keep_s, retention_s)``, five minutes by default,
  see ``trimming``). So the script's argument list is
  bounded whatever a writer put in the entry. Every text taken from input is made
  encodable first (a lone surrogate is written as ``\\ud800``).
* Dead-lettering is isolated per entry: a dead letter that fails for any reason but a
  transient one is replaced by a minimal one (reason ``internal_error``, no copied fields),
  and if even that fails the entry is acknowledged with an alarm, so that no entry can stop
  the reader or hold up the rest of its batch.

Redis writes are never re-sent by the client library (``Retry(NoBackoff(), 0)``): a write
whose reply was lost may or may not have happened, and only the caller, knowing what is
idempotent, decides to try again. Every redis-py error becomes a ``broker_adapter`` error
here, with ``raise ... from``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, NamedTuple, TypeVar

import redis
import tenacity
from pydantic import AfterValidator, Field
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry

from broker_adapter.config import ConfigModel
from broker_adapter.errors import (
    BrokerAdapterError,
    ConfigError,
    GroupMissingError,
    RedisUnavailable,
    TransientError,
)
from broker_adapter.redis import cluster

Fields = dict[bytes, bytes]
T = TypeVar("T")

#: Entries with more fields than this are dead-lettered as ``too_many_fields``.
DEFAULT_MAX_ENTRY_FIELDS = 64
#: The range ``max_entry_fields`` may take: an entry needs a few fields, and the
#: dead-letter script's argument list (two per copied field) must stay far below the
#: 7,998 values Lua can unpack.
MIN_ENTRY_FIELDS, MAX_ENTRY_FIELDS = 8, 1000
#: A bare ``ReaderConfig``'s entry size limit (the ingest and the receiver set their own:
#: ``ingest.DEFAULT_MAX_ENTRY_BYTES``, ``receiver.DEFAULT_MAX_REPLY_BYTES``).
READER_MAX_ENTRY_BYTES = 1024 * 1024
#: How many characters of a text a dead letter keeps (``dl.detail`` and the other notes).
DEAD_LETTER_TEXT_MAX_CHARS = 1000

log = logging.getLogger("broker_adapter.redis.streams")


def check_redis_url(url: str) -> str:
    """``url`` if redis-py can connect by it (``redis://``, ``rediss://`` or ``unix://``,
    a numeric port, a numeric database; or a cluster's seed node, ``redis+cluster://``
    or ``rediss+cluster://``: see ``cluster``).

    Raises:
        ConfigError: why it cannot; the message never repeats the URL (it may hold a
            password).
    """
    plain = cluster.node_url(url) if cluster.is_cluster_url(url) else url
    if not isinstance(url, str) or not plain.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(
            "bad Redis URL: must start with redis://, rediss://, unix:// or redis+cluster://"
        )
    try:
        parse_url(plain)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise ConfigError(f"bad Redis URL: {exc}") from None
    return url


#: A Redis URL field of a settings model (``check_redis_url``).
RedisUrl = Annotated[str, AfterValidator(check_redis_url)]


def connect(
    url: str, *, socket_timeout_s: float = 10.0, connect_timeout_s: float = 5.0
) -> redis.Redis:
    """A redis-py client that never re-sends a command by itself.

    Args:
        url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``); a cluster's
            ``redis+cluster://host:port`` gives a ``RedisCluster`` (``cluster``).
        socket_timeout_s: per-command socket timeout; must exceed any BLOCK used on it.
        connect_timeout_s: TCP connect timeout.

    Raises:
        ConfigError: a malformed ``url`` (``check_redis_url``).
        RedisUnavailable: a cluster none of whose seed nodes answered (a cluster client
            reads the slot map when it is made; a single Redis's connects at its first
            command).
    """
    check_redis_url(url)
    if cluster.is_cluster_url(url):
        return cluster.connect_cluster(url, _client_options(socket_timeout_s, connect_timeout_s))  # type: ignore[return-value]
    return redis.Redis.from_url(
        url, retry=Retry(NoBackoff(), 0), **_client_options(socket_timeout_s, connect_timeout_s)
    )


def _client_options(socket_timeout_s: float, connect_timeout_s: float) -> dict[str, Any]:
    """What ``connect`` and ``connect_async`` share besides their retry object."""
    return {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "retry_on_timeout": False,
        "health_check_interval": 0,
    }


@contextmanager
def translated() -> Iterator[None]:
    """Translate redis-py exceptions into the library's error tree."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise RedisUnavailable(f"redis unavailable: {exc}") from exc
    except cluster.TRANSIENT_CLUSTER_ERRORS as exc:  # redis-py strips their code words
        raise RedisUnavailable(f"redis cluster: {type(exc).__name__}: {exc}") from exc
    except redis.ResponseError as exc:
        text = str(exc)
        if text.startswith("NOGROUP"):
            raise GroupMissingError(text) from exc
        if text.startswith(("LOADING", "BUSY ", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN")):
            raise RedisUnavailable(text) from exc
        raise BrokerAdapterError(f"redis error: {text}") from exc
    except redis.RedisError as exc:
        raise RedisUnavailable(f"redis error: {exc}") from exc
    except redis.exceptions.RedisClusterException as exc:
        raise cluster.translate(exc) from exc


def call(fn: Callable[[], T]) -> T:
    """Run one Redis call with errors translated."""
    with translated():
        return fn()


def text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def encodable(value: str, limit: int = DEAD_LETTER_TEXT_MAX_CHARS) -> str:
    """``value`` cut to ``limit`` characters, with whatever UTF-8 cannot encode (lone
    surrogates, which ``json`` happily decodes from ``"\\ud800"``) written as backslash
    escapes: every text derived from input goes through this before Redis sees it."""
    value = value[:limit]
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def describe(exc: BaseException) -> str:
    """``"<class>: <message>"`` of ``exc`` in ASCII (escaped), for a dead letter's detail;
    never raises, whatever the exception's ``__str__`` does."""
    try:
        said = f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 - a broken __str__: the class name is enough
        said = type(exc).__name__
    return said.encode("ascii", "backslashreplace").decode("ascii")


# Dead-letter one entry: XADD to the dead stream and XACK the source, atomically.
# KEYS[1] source stream, KEYS[2] dead stream; ARGV[1] group, ARGV[2] entry id,
# ARGV[3..] field/value pairs of the dead-letter entry: a few notes and at most
# ``max_entry_fields`` copied fields (``GroupReader._copy``), so ``unpack`` stays bounded.
_DEAD_LETTER = """
local dead_id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return dead_id
"""


class StreamEntry(NamedTuple):
    """One delivered entry. ``fields`` is None when its payload was deleted or trimmed.
    (A tuple: one is made per entry read.)

    Attributes:
        entry_id: the stream entry id.
        fields: the fields by name (of an entry the reader passed, names are unique).
        deliveries: how often the group delivered it (XPENDING), 1 for a new entry.
        pairs: the fields as Redis keeps them, ``[name, value, name, value, ...]`` with
            any repeated name; ``None`` for an entry made from ``fields`` alone.
    """

    entry_id: str
    fields: Fields | None
    deliveries: int = 1
    pairs: Sequence[bytes] | None = None

    def flat(self) -> Sequence[bytes]:
        """The name/value pairs, flat (from ``fields`` when the raw list is not known)."""
        if self.pairs is not None:
            return self.pairs
        return [item for pair in (self.fields or {}).items() for item in pair]


class ReaderConfig(ConfigModel):
    """How a ``GroupReader`` reads.

    Attributes:
        count: entries per read (1..10,000).
        block_ms: how long a read of new entries blocks (at least 1: Redis reads ``BLOCK
            0`` as "for ever").
        claim_min_idle_ms: entries idle this long in another consumer's list are taken over.
        max_deliveries: entries delivered more often than this go to the dead-letter stream.
        max_entry_fields: entries of more fields (repeated names counted) are dead-lettered
            as ``too_many_fields``; also the most fields a dead letter copies
            (``MIN_ENTRY_FIELDS..MAX_ENTRY_FIELDS``).
        max_entry_bytes: entries larger than this (all field names and values) are
            dead-lettered as ``oversize`` before anyone parses them; also the most bytes
            a dead letter copies.

    Raises:
        ConfigError: a value outside its bounds.
    """

    count: int = Field(default=256, ge=1, le=10_000)
    block_ms: int = Field(default=1000, ge=1)
    claim_min_idle_ms: int = Field(default=60_000, ge=0)
    max_deliveries: int = Field(default=10, ge=1)
    max_entry_fields: int = Field(
        default=DEFAULT_MAX_ENTRY_FIELDS, ge=MIN_ENTRY_FIELDS, le=MAX_ENTRY_FIELDS
    )
    max_entry_bytes: int = Field(default=READER_MAX_ENTRY_BYTES, ge=1)


@dataclass
class ReaderStats:
    read: int = 0
    replayed: int = 0
    taken_over: int = 0
    acked: int = 0
    dead_lettered: int = 0
    deleted: int = 0
    group_recreated: int = 0
    reconnects: int = 0
    #: Entries acknowledged without any dead letter because even a minimal one failed.
    dead_letter_failures: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)


class GroupReader:
    """Reads one stream as one consumer of one group, at least once.

    Args:
        client: a client from ``connect`` (no automatic re-sends).
        stream: the stream key.
        group: the consumer group.
        consumer: this reader's stable name (one per process slot, reused across restarts).
        dead_stream: where poison and deleted entries go (same hash tag as ``stream``).
        config: batch sizes and limits.
        logger: where alarms go.
    """

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        group: str,
        consumer: str,
        dead_stream: str,
        config: ReaderConfig | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.client = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.dead_stream = dead_stream
        self.config = config or ReaderConfig()
        self.log = logger or log
        self.stats = ReaderStats()
        self._replaying = True
        self._cursor = "0-0"
        self._group_ready = False
        #: Entries read by the last peeking ``ack``: what the next ``read`` returns.
        self._ahead: list[StreamEntry] = []
        #: A connection taken from the pool with a ``prefetch`` read sent on it and its
        #: reply not yet read (the next ``ack`` or ``read`` reads it).
        self._inflight: Any = None
        #: The last read of new entries filled a whole batch (more are likely waiting).
        self._full = False
        self._dead_letter = client.register_script(_DEAD_LETTER)

    # -- group ----------------------------------------------------------------------------

    def ensure_group(self) -> None:
        """Create the group from ``0`` (MKSTREAM); an existing group is left as it is."""
        try:
            with translated():
                self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except BrokerAdapterError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def _recreate_group(self) -> None:
        self.log.error(
            "ALARM: consumer group %s on %s is gone (Redis lost its data?); recreating from 0",
            self.group,
            self.stream,
        )
        self.stats.group_recreated += 1
        self._drop_inflight()  # a read of the group that is gone
        self.ensure_group()
        self._replaying = True
        self._cursor = "0-0"

    def reset(self) -> None:
        """Call after any error: the next read starts again with this consumer's own pending
        (entries read ahead are dropped: they are in that list)."""
        self._ahead = []
        self._drop_inflight()
        self._replaying = True
        self.stats.reconnects += 1

    def replay(self) -> None:
        """From the next read of Redis on, re-read this consumer's own pending list before
        new entries (what ``reset`` does after an error; entries read ahead are kept)."""
        self._replaying = True

    def defer_replay(self) -> None:
        """Read new entries only and leave this consumer's own pending list alone until
        ``replay`` (or an error's ``reset``): e.g. entries whose handling just failed wait
        for a pause instead of coming back at the very next read."""
        self._replaying = False

    # -- reading --------------------------------------------------------------------------

    def read(self) -> list[StreamEntry]:
        """The next batch: own pending entries first (after start or an error), then new ones.

        Poison and deleted entries are dead-lettered here and not returned.

        Raises:
            RedisUnavailable: the read failed; call again (it will replay pending first).
        """
        if self._ahead:
            ahead, self._ahead = self._ahead, []
            return ahead  # screened when they were read
        if self._inflight is not None:
            return self._finish_prefetch(None)[0]
        if not self._group_ready:
            self.ensure_group()
        try:
            batch = self._read_once()
        except GroupMissingError:
            self._recreate_group()
            return []
        except RedisUnavailable:
            self.reset()
            raise
        return self._screen(batch)

    def _read_once(self) -> list[StreamEntry]:
        cfg = self.config
        if self._replaying:
            with translated():
                (reply,) = exchange(self.client, [self._xreadgroup("0")], raw=True)
            entries = _entries(reply)
            if not entries:
                self._replaying = False
                return []
            self.stats.replayed += len(entries)
            return self._with_deliveries(entries)
        with translated():
            (reply,) = exchange(
                self.client, [self._xreadgroup(">", block_ms=cfg.block_ms)], raw=True
            )
        entries = _entries(reply)
        self.stats.read += len(entries)
        self._full = len(entries) >= cfg.count
        return entries

    def _xreadgroup(self, start: str, *, block_ms: int | None = None) -> tuple[Any, ...]:
        """The XREADGROUP command of one batch from ``start`` (``0``: own pending, ``>``:
        new), blocking ``block_ms`` if given."""
        block = () if block_ms is None else ("BLOCK", block_ms)
        return (
            "XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", self.config.count,
            *block, "STREAMS", self.stream, start,
        )  # fmt: skip

    # -- reading ahead ----------------------------------------------------------------------

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
        self._full = False
        conn = _pool_connection(self.client.connection_pool)
        try:
            with translated():
                conn.send_command(*self._xreadgroup(">"))
        except BaseException:
            self._discard(conn)
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
        try:
            with translated():
                if entry_ids:
                    conn.send_command("XACK", self.stream, self.group, *entry_ids)
                reply = conn.read_response()  # the raw pairs (see _entries)
                acked = int(conn.read_response()) if entry_ids else 0
        except GroupMissingError:
            self._discard(conn)  # the XACK's reply, if any, is still unread on it
            self._recreate_group()
            return [], 0
        except BaseException:
            self._discard(conn)
            self.reset()
            raise
        self.client.connection_pool.release(conn)
        self.stats.acked += acked
        return self._new_entries(reply), acked

    def _drop_inflight(self) -> None:
        conn, self._inflight = self._inflight, None
        if conn is not None:
            self._discard(conn)

    def _discard(self, conn: Any) -> None:
        _discard(self.client.connection_pool, conn)

    def _new_entries(self, reply: Any) -> list[StreamEntry]:
        """The screened entries of a non-blocking read of new ones, read ahead for the next
        ``read`` (``_full`` notes whether it filled a batch)."""
        entries = _entries(reply)
        self.stats.read += len(entries)
        self._full = len(entries) >= self.config.count
        return self._screen(entries)

    def _with_deliveries(self, entries: list[StreamEntry]) -> list[StreamEntry]:
        """Attach delivery counts (from XPENDING) to entries that came from a pending list."""
        ids = [e.entry_id for e in entries]
        with translated():
            rows = self.client.xpending_range(
                self.stream, self.group, min=min(ids, key=_id_key), max=max(ids, key=_id_key),
                count=len(ids) * 2 + 10, consumername=self.consumer,
            )  # fmt: skip
        counts = {text(r["message_id"]): int(r["times_delivered"]) for r in rows}  # type: ignore[arg-type]
        return [e._replace(deliveries=counts.get(e.entry_id, 1)) for e in entries]

    def _screen(self, batch: list[StreamEntry]) -> list[StreamEntry]:
        """The entries of ``batch`` fit to be parsed; the others are dead-lettered here."""
        good: list[StreamEntry] = []
        for entry in batch:
            try:
                refusal = self._refusal(entry)
            except Exception as exc:  # noqa: BLE001 - one entry's problem, not the batch's
                self.dead_letter_exception(entry, exc, "screening it")
                continue
            if refusal is None:
                good.append(entry)
            else:
                self.dead_letter(entry, *refusal)
        return good

    def _refusal(self, entry: StreamEntry) -> tuple[str, str, dict[str, str]] | None:
        """Why ``entry`` must not be handed on, as ``(reason, detail, extra)``, or None.

        In this order: deleted, past the delivery limit, too many fields, too large, a
        repeated field name. The checks look at counts and lengths only (the per-entry cost
        on the hot path is a few list lengths)."""
        cfg = self.config
        fields = entry.fields
        if fields is None:
            self.stats.deleted += 1
            return "payload_deleted", "entry was deleted or trimmed", {}
        if entry.deliveries > cfg.max_deliveries:
            detail = f"delivered {entry.deliveries} times, limit {cfg.max_deliveries}"
            return "delivery_limit", detail, {}
        pairs = entry.flat()
        if len(pairs) > 2 * cfg.max_entry_fields:
            detail = f"entry has {len(pairs) // 2} fields, limit {cfg.max_entry_fields}"
            return "too_many_fields", detail, {"dl.field": ""}
        size = sum(map(len, pairs))
        if size > cfg.max_entry_bytes:
            detail = f"entry is {size} bytes, limit {cfg.max_entry_bytes}"
            return "oversize", detail, {"dl.field": ""}
        if 2 * len(fields) != len(pairs):
            name = text(_repeated_name(pairs))
            detail = f"field {name!r} appears more than once"
            return "duplicate_field", detail, {"dl.field": name}
        return None

    def take_over(self) -> list[StreamEntry]:
        """XAUTOCLAIM one page of entries idle past ``claim_min_idle_ms`` (from any consumer).

        The cursor is carried between calls and restarts from ``0-0`` only when Redis says
        the scan is complete. Deleted entries are dead-lettered; the rest are returned.
        """
        if not self._group_ready:
            self.ensure_group()
        try:
            with translated():
                (reply,) = exchange(self.client, [(
                    "XAUTOCLAIM", self.stream, self.group, self.consumer,
                    self.config.claim_min_idle_ms, self._cursor, "COUNT", self.config.count,
                )], raw=True)  # fmt: skip
        except GroupMissingError:
            self._recreate_group()
            return []
        except RedisUnavailable:
            self.reset()
            raise
        cursor, claimed = text(reply[0]), reply[1]
        deleted = reply[2] if len(reply) > 2 else []
        self._cursor = cursor
        for raw_id in deleted:
            # XAUTOCLAIM already removed deleted ids from the pending list: record them.
            self.stats.deleted += 1
            self._dead_letter_fields(
                text(raw_id), "payload_deleted", "entry was deleted or trimmed", 0, ack=False
            )
        entries = _stream_entries(claimed)
        if not entries:
            return []
        self.stats.taken_over += len(entries)
        return self._screen(self._with_deliveries(entries))

    @property
    def scan_complete(self) -> bool:
        """True when the last ``take_over`` reached the end of the pending list."""
        return self._cursor == "0-0"

    # -- acknowledging --------------------------------------------------------------------

    def ack(self, entry_ids: Sequence[str], *, peek: bool = False) -> int:
        """XACK a batch (one command). A count below ``len(entry_ids)`` is not an error: an
        entry acknowledged before (a lost XACK reply, a replay) counts 0.

        Args:
            entry_ids: the entries to acknowledge.
            peek: in the same round trip, read the next new entries without blocking (one
                round trip, and on an ``appendfsync always`` server one fsync, where an
                ``ack`` and a ``read`` take two); the next ``read`` returns them. Ignored
                while this reader still replays its own pending list. After a
                ``prefetch`` the read was sent already: the XACK goes on its connection and
                its reply is taken, peek or not.

        Raises:
            RedisUnavailable: the call failed; with ``peek`` (or a prefetch) both commands
                may or may not have run (the reader is reset: the next ``read`` replays its
                pending list).
        """
        if not entry_ids:
            return 0
        if self._inflight is not None:
            self._ahead, n = self._finish_prefetch(entry_ids)
            return n
        xack = ("XACK", self.stream, self.group, *entry_ids)
        if not peek or self._replaying:
            with translated():
                (acked,) = exchange(self.client, [xack], raw=True)
            n = int(acked)
            self.stats.acked += n
            return n
        try:
            with translated():
                acked, reply = exchange(self.client, [xack, self._xreadgroup(">")], raw=True)
        except GroupMissingError:
            self._recreate_group()
            return 0
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

    def dead_letter(
        self,
        entry: StreamEntry,
        reason: str,
        detail: str,
        extra: Mapping[str, str] | None = None,
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

        Returns:
            the dead-letter entry's id, or None when none could be written.

        Raises:
            TransientError: Redis could not be reached (the entry stays pending; maybe
                moved).
            BrokerAdapterError: the last resort, the XACK alone, was refused (the group is
                gone, say): a problem of the stream, not of the entry.
        """
        return self._dead_letter_fields(
            entry.entry_id, reason, detail, entry.deliveries, original=entry.flat(), extra=extra
        )

    def dead_letter_exception(self, entry: StreamEntry, exc: Exception, doing: str) -> None:
        """Dead-letter ``entry`` as ``internal_error``: handling it raised ``exc`` (a bug, or
        input no check foresaw). The exception class goes into ``dl.detail``; the traceback
        goes to the log.

        Args:
            doing: what was being done to the entry, for the detail (``"checking it"``).
        """
        self.log.error(
            "ALARM: %s raised while %s entry %s of %s; dead-lettering it as internal_error",
            type(exc).__name__, doing, entry.entry_id, self.stream, exc_info=exc,
        )  # fmt: skip
        detail = f"{describe(exc)} while {doing}"
        self.dead_letter(entry, "internal_error", detail, {"dl.field": ""})

    def dead_letter_many(
        self, refused: Sequence[tuple[StreamEntry, str, str, Mapping[str, str]]]
    ) -> int:
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
            notes, copy = self._letter(e.entry_id, reason, detail, e.deliveries, e.flat(), extra)
            calls.append(([self.stream, self.dead_stream], self._argv(e.entry_id, notes, copy)))
        results = eval_many(self.client, _DEAD_LETTER, calls)
        reasons: dict[str, int] = {}
        written = 0
        for (entry, reason, detail, extra), result in zip(refused, results, strict=True):
            if isinstance(result, BrokerAdapterError):
                written += self.dead_letter(entry, reason, detail, extra) is not None
                continue
            reasons[reason] = reasons.get(reason, 0) + 1
        for reason, n in reasons.items():
            self.stats.dead_lettered += n
            self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + n
            self.log.warning("dead-lettered %d entries from %s: %s", n, self.stream, reason)
        return written + sum(reasons.values())

    def _dead_letter_fields(
        self,
        entry_id: str,
        reason: str,
        detail: str,
        deliveries: int,
        *,
        original: Sequence[bytes] = (),
        ack: bool = True,
        extra: Mapping[str, str] | None = None,
    ) -> str | None:
        try:
            notes, copy = self._letter(entry_id, reason, detail, deliveries, original, extra)
            dead_id = self._move(entry_id, notes, copy, ack=ack)
        except TransientError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the entry held: a minimal one
            self.log.error(
                "ALARM: dead letter %r of %s from %s failed (%s: %s); writing a minimal one",
                reason, entry_id, self.stream, type(exc).__name__, exc,
            )  # fmt: skip
            minimal = {
                "dl.reason": "internal_error",
                "dl.detail": f"the {reason} dead letter failed: {describe(exc)}",
                "dl.field": "",
                "dl.source": self.stream,
                "dl.entry_id": entry_id,
                "dl.failed_reason": reason,
            }
            try:
                dead_id = self._move(entry_id, minimal, [], ack=ack)
            except TransientError:
                raise
            except Exception as last:  # noqa: BLE001 - acknowledged, with an alarm
                self._give_up(entry_id, reason, last, ack=ack)
                return None
            reason, detail = "internal_error", minimal["dl.detail"]
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
    ) -> tuple[dict[str, str], list[bytes]]:
        """The ``dl.*`` notes and the bounded ``orig.*`` copy of one dead letter."""
        notes = {
            "dl.reason": reason,
            "dl.detail": detail,
            "dl.source": self.stream,
            "dl.entry_id": entry_id,
            "dl.deliveries": str(deliveries),
            "dl.group": self.group,
            "dl.consumer": self.consumer,
        }
        for k, v in (extra or {}).items():
            notes.setdefault(k, v)
        copy, truncated = self._copy(original)
        if truncated:
            notes["dl.truncated"] = truncated
        return notes, copy

    def _argv(
        self, entry_id: str, notes: Mapping[str, str], copy: Sequence[bytes], *, ack: bool = True
    ) -> list[bytes | str]:
        """The dead-letter script's ARGV: ``notes`` (texts, made encodable), then ``copy``."""
        argv: list[bytes | str] = [self.group, entry_id if ack else "0-0"]
        for k, v in notes.items():
            argv += [k, encodable(v)]
        argv += copy
        return argv

    def _move(
        self, entry_id: str, notes: Mapping[str, str], copy: Sequence[bytes], *, ack: bool
    ) -> str:
        """Run the dead-letter script for one entry."""
        argv = self._argv(entry_id, notes, copy, ack=ack)
        with translated():
            return text(self._dead_letter(keys=[self.stream, self.dead_stream], args=argv))

    def _copy(self, original: Sequence[bytes]) -> tuple[list[bytes], str]:
        """The ``orig.<name>`` arguments of a dead letter and, when not all of ``original``
        fits in ``max_entry_fields`` fields and ``max_entry_bytes`` bytes, a note of what
        was left out (else ``""``). Names and values are copied in order, byte for byte;
        the pair that crosses the byte limit is cut, and copying stops there."""
        cfg = self.config
        total = sum(map(len, original))
        if len(original) <= 2 * cfg.max_entry_fields and total <= cfg.max_entry_bytes:
            return [b"orig." + item if i % 2 == 0 else item for i, item in enumerate(original)], ""
        copy: list[bytes] = []
        room = cfg.max_entry_bytes
        for i in range(0, min(len(original) - 1, 2 * cfg.max_entry_fields), 2):
            if room <= 0:
                break
            name = original[i][:room]
            value = original[i + 1][: room - len(name)]
            room -= len(name) + len(value)
            copy += [b"orig." + name, value]
        copied = cfg.max_entry_bytes - room
        return copy, (
            f"copied {len(copy) // 2} of {len(original) // 2} fields, {copied} of {total} "
            f"bytes; the entry stays in {self.stream} under dl.entry_id until the stream "
            "is trimmed past it"
        )

    def _give_up(self, entry_id: str, reason: str, exc: Exception, *, ack: bool) -> None:
        """The last resort when no dead letter can be written: acknowledge the entry alone,
        so that it cannot stop the reader on every replay, and say so loudly. (It is not
        deleted: it stays in the stream under its id.)"""
        self.stats.dead_letter_failures += 1
        self.log.error(
            "ALARM: no dead letter could be written for %s of %s (%s; %s: %s); acknowledging "
            "it without one (it stays in the stream under its id)",
            entry_id, self.stream, reason, type(exc).__name__, exc,
        )  # fmt: skip
        if ack:
            with translated():
                exchange(self.client, [("XACK", self.stream, self.group, entry_id)], raw=True)

    # -- inspection -----------------------------------------------------------------------

    def pending(self) -> dict[str, int]:
        """Pending entries per consumer of this group."""
        with translated():
            info = self.client.xpending(self.stream, self.group)
        return {text(c["name"]): int(c["pending"]) for c in info.get("consumers") or []}


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def exchange(
    client: redis.Redis,
    commands: Sequence[Sequence[Any]],
    *,
    raise_errors: bool = True,
    raw: bool = False,
) -> list[Any]:
    """Send ``commands`` in one write on one connection of the client's pool and read their
    replies in order: one round trip, without redis-py's per-command and pipeline layers
    (on the hot paths those cost more CPU than the round trip's own work). Replies go
    through the client's response callbacks, as ``client.xreadgroup(...)`` would return
    them, unless ``raw``. Nothing is ever re-sent.

    Args:
        raise_errors: raise the first error reply after all replies were read; otherwise
            each error reply is left in its slot as its ``redis.ResponseError``.
        raw: leave the replies as the server sent them (stream entries as flat name/value
            lists: see ``_entries``).

    Raises:
        redis.RedisError: a connection failure (the connection is closed; any prefix of the
            commands may have run), or an error reply with ``raise_errors``. Callers
            translate (``translated``).
    """
    if cluster.is_cluster(client):
        return cluster.routed_exchange(
            client,  # type: ignore[arg-type]
            commands, exchange, raise_errors=raise_errors, raw=raw,
        )  # fmt: skip
    pool = client.connection_pool
    conn = _pool_connection(pool)
    replies: list[Any] = []
    try:
        conn.send_packed_command(conn.pack_commands(commands))
        for command in commands:
            try:
                if raw:
                    replies.append(conn.read_response())
                else:
                    replies.append(client.parse_response(conn, command[0]))  # type: ignore[no-untyped-call]
            except redis.ResponseError as exc:
                replies.append(exc)
    except BaseException:
        _discard(pool, conn)
        raise
    pool.release(conn)
    if raise_errors:
        for reply in replies:
            if isinstance(reply, redis.ResponseError):
                raise reply
    return replies


def _pool_connection(pool: Any) -> Any:
    """A connection of its own from ``pool`` (redis-py before 5.3 wants a command name)."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("XREADGROUP")


def _discard(pool: Any, conn: Any) -> None:
    """Close a connection whose reply may be unread (it cannot be reused as it is) and give
    it back to ``pool``."""
    conn.disconnect()
    pool.release(conn)


def _entries(reply: Any) -> list[StreamEntry]:
    """The entries of a raw XREADGROUP reply (RESP2: a list of ``[stream, entries]``;
    RESP3: a map of them), one delivery each."""
    if not reply:
        return []
    streams = reply.items() if isinstance(reply, dict) else reply
    out: list[StreamEntry] = []
    for _stream, items in streams:
        out += _stream_entries(items)
    return out


def _stream_entries(items: Any) -> list[StreamEntry]:
    """``[[id, [name, value, ...]], ...]`` as entries; nil or empty fields (the payload was
    deleted) become ``fields=None``. A repeated name shows as fewer dict keys than pairs
    (``GroupReader._refusal`` refuses the entry)."""
    out: list[StreamEntry] = []
    for eid, pairs in items or ():
        if pairs:
            it = iter(pairs)
            out.append(StreamEntry(text(eid), dict(zip(it, it, strict=False)), 1, pairs))
        else:
            out.append(StreamEntry(text(eid), None, 1, None))
    return out


def _repeated_name(pairs: Sequence[bytes]) -> bytes:
    """The first field name that ``pairs`` repeats (``b""`` if none does)."""
    seen: set[bytes] = set()
    for name in pairs[::2]:
        if name in seen:
            return name
        seen.add(name)
    return b""


def retrying(*, max_wait_s: float = 5.0, multiplier_s: float = 0.05) -> tenacity.Retrying:
    """A tenacity policy for loops that talk to Redis or SQLite: retry ``TransientError``
    forever with capped exponential backoff and full jitter."""
    from broker_adapter.errors import TransientError

    return tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(TransientError),
        wait=tenacity.wait_random_exponential(multiplier=multiplier_s, max=max_wait_s),
        reraise=True,
        before_sleep=lambda state: log.warning(
            "transient failure (attempt %d), backing off: %s",
            state.attempt_number,
            state.outcome.exception() if state.outcome else "?",
        ),
    )


def run_until_stopped(
    stop: threading.Event,
    tick: Callable[[], object],
    *,
    before_sleep: Callable[[tenacity.RetryCallState], None] | None = None,
    sleep: Callable[[float], object] | None = None,
) -> None:
    """Call ``tick`` until ``stop`` is set; on ``TransientError`` back off with the
    ``retrying`` policy (a stop request cuts the backoff short) and go on.

    The policy wraps a run of ticks, not each tick: its bookkeeping costs about 20 µs a
    call, as much as the work of a one-entry batch. A run ends at the first tick that
    succeeds after a backoff, so that the backoff grows over consecutive failures only,
    as it did with one policy call per tick.

    Args:
        stop: set it to return (after the tick in progress).
        tick: one iteration of the caller's loop.
        before_sleep: called before each backoff instead of ``retrying``'s log line.
        sleep: how a backoff waits (``stop.wait``: a stop ends it at once).

    Raises:
        BrokerAdapterError: a failure that is not transient (the loop stops loudly).
    """
    from broker_adapter.errors import TransientError

    base = retrying()
    announce = before_sleep or base.before_sleep
    backed_off = False

    def on_sleep(state: tenacity.RetryCallState) -> None:
        nonlocal backed_off
        backed_off = True
        if announce is not None:
            announce(state)

    policy = base.copy(
        stop=tenacity.stop_when_event_set(stop),
        sleep=sleep or stop.wait,
        before_sleep=on_sleep,
    )

    def ticks() -> None:
        nonlocal backed_off
        while not stop.is_set():
            tick()
            if backed_off:  # recovered: a fresh policy call starts the backoff over
                backed_off = False
                return

    while not stop.is_set():
        try:
            policy(ticks)
        except TransientError:
            if not stop.is_set():  # pragma: no cover - the policy never gives up
                raise
            log.info("stopping during a backoff")


def connect_async(
    url: str, *, socket_timeout_s: float = 10.0, connect_timeout_s: float = 5.0
) -> redis.asyncio.Redis:
    """The ``redis.asyncio`` twin of ``connect``: a client that never re-sends a command.

    Args:
        url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``).
        socket_timeout_s: per-command socket timeout; must exceed any BLOCK used on it.
        connect_timeout_s: TCP connect timeout.

    Raises:
        ConfigError: a malformed ``url`` (``check_redis_url``).
    """
    import redis.asyncio
    from redis.asyncio.retry import Retry as AsyncRetry

    check_redis_url(url)
    if cluster.is_cluster_url(url):
        return cluster.connect_cluster_async(url, socket_timeout_s, connect_timeout_s)  # type: ignore[no-any-return]
    return redis.asyncio.Redis.from_url(
        url,
        retry=AsyncRetry(NoBackoff(), 0),
        **_client_options(socket_timeout_s, connect_timeout_s),
    )


# -- batched scripts (added for the reply dispatcher) ------------------------------------


@functools.lru_cache(maxsize=64)
def script_sha(source: str) -> str:
    """The SHA-1 Redis files a script under (what EVALSHA takes); computed once per script
    (a worker publishing one reply per batch hashed the whole script every time)."""
    return hashlib.sha1(source.encode("utf-8")).hexdigest()


def _as_error(exc: redis.ResponseError) -> BrokerAdapterError:
    try:
        with translated():
            raise exc
    except BrokerAdapterError as out:
        return out


def eval_many(
    client: redis.Redis,
    source: str,
    calls: Sequence[tuple[Sequence[str], Sequence[bytes | str | int]]],
) -> list[Any]:
    """Run one Lua script once per ``(keys, args)`` call, pipelined in ONE round trip.

    A call the server refused (a script error, WRONGTYPE, OOM) gets the translated error
    *instance* in its result slot instead of failing its neighbours. Calls refused with
    NOSCRIPT (first use on a server, or a restart emptied the script cache) did not run:
    the script is loaded and only those calls are sent again.

    Returns:
        one result per call, in order: the script's reply or a ``BrokerAdapterError``.

    Raises:
        RedisUnavailable: the round trip failed; any prefix of the calls may have run.
    """
    sha = script_sha(source)
    results: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for attempt in range(2):
        with translated():
            replies = exchange(
                client,
                [("EVALSHA", sha, len(calls[i][0]), *calls[i][0], *calls[i][1]) for i in todo],
                raise_errors=False,
            )
        missing: list[int] = []
        for i, reply in zip(todo, replies, strict=True):
            if isinstance(reply, redis.exceptions.NoScriptError) and attempt == 0:
                missing.append(i)
            elif isinstance(reply, redis.ResponseError):
                results[i] = _as_error(reply)
            else:
                results[i] = reply
        if not missing:
            break
        with translated():
            client.script_load(source)
        todo = missing
    return results
