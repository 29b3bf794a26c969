"""A worker's publication of its own replies, right after the commit that wrote them.

The worker's batch commit writes its replies claimed for the worker's publisher
(``<worker>-pub``); the worker publishes them through the one publication path
(``stages.shared.publish.ReplyPublisher``), and the next commit carries the marks of those
Redis confirmed (or a small transaction of their own does). What the worker cannot
publish, the dispatcher sweeps when the publisher's lease runs out.
"""

from __future__ import annotations

import time

from broker_adapter import crashpoints
from broker_adapter.clock import Clock
from broker_adapter.errors import StaleError, TransientError
from broker_adapter.stages.shared.publish import Publication, ReplyPublisher
from broker_adapter.store.outbox_types import OutboxRow, SentMark
from broker_adapter.store.settle import SettledBatch, Settlement
from broker_adapter.store.tasks import TaskStore

#: After Redis failed a worker's publication, its replies go to the dispatcher this long.
PUBLISH_PAUSE_S = 1.0


#: A publication Redis confirmed, waiting for its mark: (row, publication, confirmed at).
Confirmed = tuple[OutboxRow, Publication, float]


def sent_marks(confirmed: list[Confirmed]) -> list[SentMark]:
    """Confirmed publications as ``(reply_id, fence, entry_id, sent_at)`` marks."""
    return [(row.reply_id, row.fence, pub.entry_id or "", at) for row, pub, at in confirmed]


class OwnReplies:
    """A worker's publication of the replies its own commits wrote claimed for its
    ``publisher``, and the confirmed ones waiting for their marks.

    The marks wait for the worker's next commit to carry them (``settle_batch``), or are
    written by a small transaction of their own (``mark_sent``). Rows Redis did not confirm
    go back in line with backoff (``ReplyPublisher.settle_failures``); for
    ``PUBLISH_PAUSE_S`` after an unreachable Redis the worker leaves new replies to the
    dispatcher (``paused``).

    Args:
        publisher: the worker's publisher identity (owner ``<worker>-pub``).
        clock: stamps each confirmation (its ``sent_at``).
    """

    def __init__(self, publisher: ReplyPublisher, clock: Clock) -> None:
        self.publisher = publisher
        self._clock = clock
        self._confirmed: list[Confirmed] = []
        #: ``time.monotonic()`` of the oldest confirmation waiting for its mark.
        self.confirmed_at = 0.0
        self._paused_until = 0.0

    @property
    def waiting(self) -> bool:
        """Whether confirmed publications wait for their marks."""
        return bool(self._confirmed)

    def paused(self) -> bool:
        """Whether new replies are left to the dispatcher (Redis failed lately)."""
        return time.monotonic() < self._paused_until

    def _marked(self, confirmed: list[Confirmed], refused: list[StaleError | None]) -> None:
        """A commit wrote the marks of ``confirmed`` (``refused``: one entry each)."""
        crashpoints.hit("dispatcher.after_mark_sent")
        self.publisher.count_marked([(row, pub) for row, pub, _ in confirmed], refused)

    def settle_batch(
        self, tasks: TaskStore, items: list[Settlement], owner: str, n: int
    ) -> SettledBatch:
        """A worker's batch commit (``TaskStore.settle_batch``: outcomes, the next claim of
        up to ``n``) that also writes its replies claimed by the publisher and carries the
        marks of the confirmations waiting."""
        publisher = self.publisher
        confirmed, self._confirmed = self._confirmed, []
        try:
            batch = tasks.settle_batch(
                items,
                owner,
                n,
                publish_as=publisher.owner,
                publish_lease_s=publisher.outbox.policy.lease_s,
                sent=sent_marks(confirmed),
            )
        except BaseException:
            self._confirmed = confirmed + self._confirmed  # not written: still to mark
            raise
        if confirmed:
            self._marked(confirmed, batch.marks)
        return batch

    def publish(self, rows: list[OutboxRow]) -> None:
        """Publish rows a commit wrote claimed for the publisher; the confirmed ones wait
        for their marks, the others go back in line with backoff, or ``dead``."""
        publisher = self.publisher
        pubs = publisher.publish(rows)
        confirmed_at = self._clock.now()
        done = publisher.confirmed(rows, pubs)
        if not self._confirmed:
            self.confirmed_at = time.monotonic()
        self._confirmed += [(row, pub, confirmed_at) for row, pub in done]
        if len(done) < len(rows):
            unreachable = [p for p in pubs if p.transient]
            if unreachable:
                self._paused_until = time.monotonic() + PUBLISH_PAUSE_S
                publisher.log.warning(
                    "publishing %d replies failed (left to the dispatcher for %.1f s): %s",
                    len(unreachable),
                    PUBLISH_PAUSE_S,
                    unreachable[0].detail,
                )
            try:
                publisher.settle_failures(rows, pubs)
            except TransientError as exc:
                publisher.log.warning(
                    "replies not put back in line; they return at lease expiry: %s", exc
                )

    def mark_sent(self) -> bool:
        """Mark the confirmed publications sent now, in one transaction of their own;
        returns whether a mark-sent transaction committed."""
        if not self._confirmed:
            return False
        confirmed, self._confirmed = self._confirmed, []
        publisher = self.publisher
        try:
            refused = publisher.outbox.mark_sent_marks(publisher.owner, sent_marks(confirmed))
        except TransientError as exc:
            # Published and recorded in Redis: when the lease runs out the dispatcher takes
            # them back, its publication finds the records and marks them sent.
            publisher.log.warning("%d replies not marked sent: %s", len(confirmed), exc)
            return False
        self._marked(confirmed, refused)
        return True
