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
* Entries whose payload was deleted or trimmed (nil fields, or XAUTOCLAIM's deleted list)
  and entries delivered more than ``max_deliveries`` times are moved to the dead-letter
  stream with their reason and acknowledged in ONE Lua script (atomic, even across an AOF
  tail loss), so they are neither looped on nor silently dropped.

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
from typing import Any, NamedTuple, TypeVar

import redis
import tenacity
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker_adapter.errors import BrokerAdapterError, GroupMissingError, RedisUnavailable

Fields = dict[bytes, bytes]
T = TypeVar("T")

log = logging.getLogger("broker_adapter.streams")


def connect(
    url: str, *, socket_timeout_s: float = 10.0, connect_timeout_s: float = 5.0
) -> redis.Redis:
    """A redis-py client that never re-sends a command by itself.

    Args:
        url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``).
        socket_timeout_s: per-command socket timeout; must exceed any BLOCK used on it.
        connect_timeout_s: TCP connect timeout.
    """
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
    except redis.ResponseError as exc:
        text = str(exc)
        if text.startswith("NOGROUP"):
            raise GroupMissingError(text) from exc
        if text.startswith(("LOADING", "BUSY ", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN")):
            raise RedisUnavailable(text) from exc
        raise BrokerAdapterError(f"redis error: {text}") from exc
    except redis.RedisError as exc:
        raise RedisUnavailable(f"redis error: {exc}") from exc


def call(fn: Callable[[], T]) -> T:
    """Run one Redis call with errors translated."""
    with translated():
        return fn()


def text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


# Dead-letter one entry: XADD to the dead stream and XACK the source, atomically.
# KEYS[1] source stream, KEYS[2] dead stream; ARGV[1] group, ARGV[2] entry id,
# ARGV[3..] field/value pairs of the dead-letter entry.
_DEAD_LETTER = """
local dead_id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return dead_id
"""


class StreamEntry(NamedTuple):
    """One delivered entry. ``fields`` is None when its payload was deleted or trimmed.
    (A tuple: one is made per entry read.)"""

    entry_id: str
    fields: Fields | None
    deliveries: int = 1


@dataclass(frozen=True)
class ReaderConfig:
    """How a ``GroupReader`` reads.

    Attributes:
        count: entries per read.
        block_ms: how long a read of new entries blocks.
        claim_min_idle_ms: entries idle this long in another consumer's list are taken over.
        max_deliveries: entries delivered more often than this go to the dead-letter stream.
    """

    count: int = 256
    block_ms: int = 1000
    claim_min_idle_ms: int = 60_000
    max_deliveries: int = 10


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
                (reply,) = exchange(self.client, [self._xreadgroup("0")])
            entries = _entries(reply)
            if not entries:
                self._replaying = False
                return []
            self.stats.replayed += len(entries)
            return self._with_deliveries(entries)
        with translated():
            (reply,) = exchange(self.client, [self._xreadgroup(">", block_ms=cfg.block_ms)])
        entries = _entries(reply)
        self.stats.read += len(entries)
        self._full = len(entries) >= cfg.count
        return [StreamEntry(eid, f, 1) for eid, f in entries]

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
                reply = self.client.parse_response(conn, "XREADGROUP")  # type: ignore[no-untyped-call]
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
        return self._screen([StreamEntry(eid, f, 1) for eid, f in entries])

    def _with_deliveries(self, entries: list[tuple[str, Fields | None]]) -> list[StreamEntry]:
        """Attach delivery counts (from XPENDING) to entries that came from a pending list."""
        ids = [eid for eid, _ in entries]
        with translated():
            rows = self.client.xpending_range(
                self.stream, self.group, min=min(ids, key=_id_key), max=max(ids, key=_id_key),
                count=len(ids) * 2 + 10, consumername=self.consumer,
            )  # fmt: skip
        counts = {text(r["message_id"]): int(r["times_delivered"]) for r in rows}  # type: ignore[arg-type]
        return [StreamEntry(eid, f, counts.get(eid, 1)) for eid, f in entries]

    def _screen(self, batch: list[StreamEntry]) -> list[StreamEntry]:
        good: list[StreamEntry] = []
        for entry in batch:
            if entry.fields is None:
                self.stats.deleted += 1
                self.dead_letter(entry, "payload_deleted", "entry was deleted or trimmed")
            elif entry.deliveries > self.config.max_deliveries:
                self.dead_letter(
                    entry,
                    "delivery_limit",
                    f"delivered {entry.deliveries} times, limit {self.config.max_deliveries}",
                )
            else:
                good.append(entry)
        return good

    def take_over(self) -> list[StreamEntry]:
        """XAUTOCLAIM one page of entries idle past ``claim_min_idle_ms`` (from any consumer).

        The cursor is carried between calls and restarts from ``0-0`` only when Redis says
        the scan is complete. Deleted entries are dead-lettered; the rest are returned.
        """
        if not self._group_ready:
            self.ensure_group()
        try:
            with translated():
                reply = self.client.xautoclaim(
                    self.stream, self.group, self.consumer,
                    min_idle_time=self.config.claim_min_idle_ms,
                    start_id=self._cursor, count=self.config.count,
                )  # fmt: skip
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
        entries = [(text(eid), f or None) for eid, f in claimed]
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
                (acked,) = exchange(self.client, [xack])
            n = int(acked)
            self.stats.acked += n
            return n
        try:
            with translated():
                acked, reply = exchange(self.client, [xack, self._xreadgroup(">")])
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
        *,
        extra: Mapping[str, str] | None = None,
    ) -> str:
        """Move ``entry`` to the dead-letter stream with its reason, and XACK it, atomically.

        Args:
            entry: the entry to move.
            reason: machine-readable reason code (``dl.reason``).
            detail: human-readable explanation (``dl.detail``, cut to 1000 characters).
            extra: more ``dl.*`` fields to record, e.g. ``{"dl.field": "payload"}``.

        Returns:
            the dead-letter entry's id.
        """
        return self._dead_letter_fields(
            entry.entry_id, reason, detail, entry.deliveries, original=entry.fields, extra=extra
        )

    def dead_letter_many(
        self, refused: Sequence[tuple[StreamEntry, str, str, Mapping[str, str]]]
    ) -> int:
        """``dead_letter`` for many entries, pipelined in one round trip (the script runs
        once per entry, each atomic on its own), with one log line per reason: the path
        for a flood refused by the ingress limits, where a round trip and a log line per
        entry would cost more than accepting it.

        Args:
            refused: ``(entry, reason, detail, extra)`` per entry.

        Returns:
            how many were dead-lettered.

        Raises:
            BrokerAdapterError: a call the server refused (the others ran).
            RedisUnavailable: the round trip failed; any prefix of the calls may have run.
        """
        calls = [
            (
                [self.stream, self.dead_stream],
                self._dead_letter_args(
                    e.entry_id, reason, detail, e.deliveries, original=e.fields, extra=extra
                ),
            )
            for e, reason, detail, extra in refused
        ]
        results = eval_many(self.client, _DEAD_LETTER, calls)
        reasons: dict[str, int] = {}
        for (_, reason, _, _), result in zip(refused, results, strict=True):
            if not isinstance(result, BrokerAdapterError):
                reasons[reason] = reasons.get(reason, 0) + 1
        for reason, n in reasons.items():
            self.stats.dead_lettered += n
            self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + n
            self.log.warning("dead-lettered %d entries from %s: %s", n, self.stream, reason)
        for result in results:
            if isinstance(result, BrokerAdapterError):
                raise result
        return sum(reasons.values())

    def _dead_letter_fields(
        self,
        entry_id: str,
        reason: str,
        detail: str,
        deliveries: int,
        *,
        original: Fields | None = None,
        ack: bool = True,
        extra: Mapping[str, str] | None = None,
    ) -> str:
        argv = self._dead_letter_args(
            entry_id, reason, detail, deliveries, original=original, ack=ack, extra=extra
        )
        with translated():
            dead_id = self._dead_letter(keys=[self.stream, self.dead_stream], args=argv)
        self.stats.dead_lettered += 1
        self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + 1
        self.log.warning("dead-lettered %s from %s: %s (%s)", entry_id, self.stream, reason, detail)
        return text(dead_id)

    def _dead_letter_args(
        self,
        entry_id: str,
        reason: str,
        detail: str,
        deliveries: int,
        *,
        original: Fields | None = None,
        ack: bool = True,
        extra: Mapping[str, str] | None = None,
    ) -> list[bytes | str]:
        """The dead-letter script's ARGV for one entry."""
        argv: list[bytes | str] = [self.group, entry_id]
        meta = {
            "dl.reason": reason,
            "dl.detail": detail[:1000],
            "dl.source": self.stream,
            "dl.entry_id": entry_id,
            "dl.deliveries": str(deliveries),
            "dl.group": self.group,
            "dl.consumer": self.consumer,
        }
        for k, v in (extra or {}).items():
            meta.setdefault(k, v[:1000])
        for k, v in meta.items():
            argv += [k, v]
        for name, value in (original or {}).items():
            argv += [b"orig." + name, value]
        if not ack:
            argv[1] = "0-0"  # nothing left to acknowledge
        return argv

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
    client: redis.Redis, commands: Sequence[Sequence[Any]], *, raise_errors: bool = True
) -> list[Any]:
    """Send ``commands`` in one write on one connection of the client's pool and read their
    replies in order: one round trip, without redis-py's per-command and pipeline layers
    (on the hot paths those cost more CPU than the round trip's own work). Replies go
    through the client's response callbacks, as ``client.xreadgroup(...)`` would return
    them. Nothing is ever re-sent.

    Args:
        raise_errors: raise the first error reply after all replies were read; otherwise
            each error reply is left in its slot as its ``redis.ResponseError``.

    Raises:
        redis.RedisError: a connection failure (the connection is closed; any prefix of the
            commands may have run), or an error reply with ``raise_errors``. Callers
            translate (``translated``).
    """
    pool = client.connection_pool
    conn = _pool_connection(pool)
    replies: list[Any] = []
    try:
        conn.send_packed_command(conn.pack_commands(commands))
        for command in commands:
            try:
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


def _entries(reply: Any) -> list[tuple[str, Fields | None]]:
    out: list[tuple[str, Fields | None]] = []
    for _stream, items in reply or []:
        for eid, fields in items:
            out.append((text(eid), fields or None))
    return out


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
    """
    import redis.asyncio
    from redis.asyncio.retry import Retry as AsyncRetry

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
