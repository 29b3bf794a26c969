"""Redis data-loss detection for the reply streams: a wipe or a restart puts replies back in line.

Redis data loss (``docs/RULES.md``, "What Redis may lose"). Before each batch the dispatcher
(``LossWatch.watch``) reads the epoch key (``{p}:{meta}:epoch``, set once with NX to a
random value) and ``INFO server``:

* epoch key gone or changed (a wipe, FLUSHALL, a new server): ALARM, every ``sent`` row of
  the reply window (``OutboxPolicy.reply_window_s``; older replies are never sent again) is
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

The epoch a dispatcher saw is also kept in its database (``meta``, ``redis_epoch``): a
dispatcher that was down during a wipe and starts after another one (sharing the Redis) set
a new epoch sees the change. And a missing key alone is not a wipe: when the publication
record of the reply confirmed last before the previous look is still there, only the key
was deleted; it is set back to the kept epoch with an ALARM, and nothing is re-sent. (Past
the record's lifetime, ``record_window_s``, with nothing sent since, a missing key still
counts as a wipe: the safe side, its resends are deduplicated.)
A prefix (whose epoch key this is) is bound to one store (``app.binding``): every
dispatcher of the prefix shares that one outbox, so the first to see a wipe puts back the
rows of all of them.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from broker_adapter.clock import Clock
from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import text, translated
from broker_adapter.redis.cluster import cluster_server_info, is_cluster
from broker_adapter.redis.internals import exchange
from broker_adapter.stages.shared.publish import DispatcherStats
from broker_adapter.store.outbox import OutboxStore

if TYPE_CHECKING:
    from broker_adapter.redis.client import Redis

DEFAULT_LOSS_WINDOW_S = 2.0
#: After a data loss, the sent rows of the lost window are looked at again this long after
#: the alarm, and once more when every publisher lease then held has run out (see
#: ``Dispatcher.watch``: a worker's mark-sent can commit after the alarm).
RECHECK_AFTER_S = 1.0
IDMP_MIN_VERSION = (8, 6)


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


def parse_version(version: str) -> tuple[int, ...]:
    """``"7.0.15"`` -> ``(7, 0, 15)``; unparsable parts count as 0."""
    parts: list[int] = []
    for piece in version.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


class LossWatch:
    """Watches one Redis for data loss (epoch key, ``run_id``) on behalf of a dispatcher,
    and puts the replies it may have lost back in line (see the module's text).

    Args:
        client: a client from ``redis.client.connect``.
        outbox: the outbox whose ``sent`` rows are put back.
        keys: the key layout (the epoch key).
        loss_window_s: how far back a restart can have lost acknowledged writes, seconds.
        clock: time source.
        stats: where wipes, restarts and requeued rows are counted.
        logger: where alarms go.
    """

    def __init__(
        self,
        client: Redis,
        outbox: OutboxStore,
        keys: Keys,
        *,
        loss_window_s: float,
        clock: Clock,
        stats: DispatcherStats,
        logger: logging.Logger,
    ) -> None:
        self.client = client
        self.outbox = outbox
        self.keys = keys
        self.loss_window_s = loss_window_s
        self.clock = clock
        self.stats = stats
        self.log = logger
        self.redis_version: str | None = None
        #: True when the server takes ``XADD ... IDMP`` (Redis >= 8.6); noted, not used.
        self.idmp_supported: bool | None = None
        self._epoch: str | None = None
        self._run_id: str | None = None
        #: Set once INFO failed and that was logged (it is said once, not at every look).
        self._info_refused = False
        self._last_ok_at: float | None = None
        self._rechecks: list[_Recheck] = []

    def watch(self) -> Watch:
        """Look for Redis data loss (epoch key, ``run_id``) and put lost replies back in line.

        Returns:
            what was found and how many rows were put back.

        Raises:
            RedisUnavailable: Redis could not be asked; nothing was changed.
        """
        now = self.clock.now()
        epoch_key = self.keys.epoch()
        with translated():  # one round trip; on a cluster, INFO goes to the epoch key's master
            raw_epoch, info = exchange(
                self.client, [("GET", epoch_key), ("INFO", "server")], raise_errors=False
            )
        if isinstance(raw_epoch, Exception):
            with translated():
                raise raw_epoch
        if isinstance(info, Exception):
            # Refused by an ACL without +info, or a server without INFO (an embedded fake):
            # only the epoch key can be watched.
            self._note_info_refused(info)
            info = {}
        elif is_cluster(self.client):
            with translated():  # every master's: a failover anywhere reads as a restart
                info = cluster_server_info(self.client)
        epoch = None if raw_epoch is None else text(raw_epoch)
        run_id = str(info.get("run_id", ""))
        uptime_s = float(info.get("uptime_in_seconds", 0))
        self._note_version(str(info.get("redis_version", "0")))
        event, requeued = LossEvent.NONE, 0
        rechecked = self._recheck(now)
        known = self._epoch if self._epoch is not None else self.outbox.redis_epoch()
        if epoch is None and known is not None and self._kept_data(now):
            epoch = self._restore_epoch(known)  # the key alone was deleted: not a wipe
        if self._epoch is None:  # first look since this dispatcher started
            if epoch is None and self.outbox.counts()["sent"] > 0:
                event, requeued = LossEvent.WIPE, self._requeue_all("epoch key missing at start")
            elif epoch is not None and known is not None and epoch != known:
                event, requeued = LossEvent.WIPE, self._requeue_all("epoch changed while down")
            elif epoch is not None:
                requeued = self.outbox.requeue_sent_near(now - uptime_s, self.loss_window_s)
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
            since = last_ok - self.loss_window_s
            requeued = self.outbox.requeue_sent(since)
            self._schedule_recheck(since, now)
            self.stats.restarts += 1
            self.log.warning(
                "Redis restarted (run_id %s -> %s): %d replies sent in its last %.1f s put back"
                " in line (appendfsync everysec may have lost them)",
                self._run_id,
                run_id,
                requeued,
                self.loss_window_s,
            )
        if epoch is None:
            epoch = self._set_epoch()
        if epoch != known:
            self.outbox.set_redis_epoch(epoch)
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

    def _set_epoch(self, value: str | None = None) -> str:
        key = self.keys.epoch()
        with translated():
            pipe = self.client.pipeline(transaction=False)
            pipe.set(key, value or secrets.token_hex(16), nx=True)
            pipe.get(key)
            _, raw = pipe.execute()
        return text(raw)

    def _kept_data(self, now: float) -> bool:
        """Whether Redis still holds what it held at the last look, though the epoch key is
        gone: the publication record of the reply confirmed last before that look is there
        (a wipe removes it; a reply published after the wipe has a record of its own, so
        only rows sent before the last look count). Without such a row, or past its
        record's lifetime, nothing says so and the missing key counts as a wipe."""
        row = self.outbox.newest_sent(self._last_ok_at if self._last_ok_at is not None else now)
        if row is None:
            return False
        with translated():
            return bool(self.client.exists(self.keys.reply_record(row.principal, row.reply_id)))

    def _restore_epoch(self, known: str) -> str:
        """Set the epoch key back to ``known`` (the one this database kept) and say so."""
        self.stats.epoch_restored += 1
        self.log.error(
            "ALARM: the Redis epoch key %s was deleted but Redis kept its data (a recent"
            " reply's publication record is there): not a wipe, nothing re-sent; key restored",
            self.keys.epoch(),
        )
        return self._set_epoch(known)

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
