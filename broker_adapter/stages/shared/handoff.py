"""The ingest hands newly accepted tasks to idle worker processes, already claimed for them.

Without it an idle worker is woken after the ingest's commit and claims the new task in a
transaction of its own: one more write lock turn and one more fsync on every task's way,
and, with several workers woken for one task, claims that find nothing. With it the ingest's
accept transaction also claims the new tasks for the workers that wait idle
(``TaskStore.accept_and_claim``: the very claim a worker makes, lease, attempts+1, fence+1),
and after the commit sends each of those workers the ``(task_id, fence)`` handles of its
tasks; the worker reads them (``TaskStore.handed``, a read) and runs them.

The protocol, per worker slot (``WANTS`` below is a process-shared array, one cell per slot):

* an idle worker writes how many tasks it wants into its cell, then waits on its pipe;
* the ingest, before its accept transaction, takes the cells of idle workers it needs
  (``Handoff.take``: each set to 0 under the array's lock) and, after the transaction,
  sends each taken worker exactly one message (``Handoff.give``): its handles, ``LOOK``
  when the claim found nothing for it, or ``CLAIM`` (tasks were stored that nobody was
  handed: claim them yourself);
* a worker about to commit its last batch offers itself the same way (``offer``: a
  negative cell) and leaves the cell after the commit (``withdraw``), taking the message if
  an accept took it meanwhile; idle workers are taken first, and ``CLAIM`` goes to idle
  ones only, since the finishing commit claims the ready tasks itself;
* a worker that stops waiting (timeout, stop) resets its cell under the same lock; when it
  finds it already taken, the ingest's message is on its way and it receives it first
  (a message that outlives that wait, ``RECEIVE_TIMEOUT_S``, is taken by the next wait
  before the worker sits down again).

So a pipe holds at most one message and every message is small (at most ``HANDOFF_MAX``
handles): a send never blocks on a full pipe. Lost wake-ups: the ingest counts its commits
that stored tasks (``stored``); a worker compares the count before it waits with the one it
saw when it last looked, and looks (a read) instead of waiting when they differ. Commits
that come after its cell is set find the cell instead.

Crash: the handles are only a shortcut. A worker killed before or after it received them
leaves its tasks ``running`` under its owner name until the lease expires, as after its own
claim; the runner killed between its commit and the message (``store.accept.after_commit``)
takes its workers with it, and the tasks come back at lease expiry. A pipe is made per
worker process: a replacement never reads what was meant for the dead one, and a message
sent to a dead worker's pipe is dropped (``give`` reports it).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any, Final, Literal

from broker_adapter.stages.shared.loop import CLAIM, LOOK, Handed, Handle
from broker_adapter.store.inbox import AcceptItem, AcceptResult, Outcome
from broker_adapter.store.tasks import TaskStore

log = logging.getLogger("broker_adapter.stages.handoff")

#: The most tasks one hand-off carries (``(task_id, fence)`` pairs: a few KiB at most).
HANDOFF_MAX: Final = 128
#: How long a worker whose cell was taken waits for the ingest's message at most (the
#: ingest's accept transaction stands between; its busy timeout is shorter).
RECEIVE_TIMEOUT_S: Final = 30.0


class HandoffEndpoint:
    """A worker process's end: its cell in the shared array and its pipe's reading end.

    Made by ``Handoff.endpoint`` in the parent and passed to the child at spawn.
    """

    def __init__(self, slot: int, reader: Connection, wants: Any, stored: Any) -> None:
        self.slot = slot
        self._reader = reader
        self._wants = wants
        self._stored = stored
        self._seen = -1  # the first wait looks

    def wait(self, timeout_s: float, want: int) -> Handed:
        """Wait idle for up to ``timeout_s`` for tasks (at most ``want``).

        Returns:
            the handles of tasks claimed for this worker; ``LOOK`` when tasks were stored
            since this worker last looked, or it was taken and given nothing; ``CLAIM`` when
            tasks were stored that nobody was handed; ``None`` when nothing came.
        """
        stored = self._stored.value
        if stored != self._seen:
            self._seen = stored
            return LOOK
        if self._ready(0.0):  # a message that came after an earlier wait gave up on it
            return self._receive()
        with self._wants.get_lock():
            self._wants[self.slot] = max(1, min(want, HANDOFF_MAX))
        if self._stored.value != stored:  # a commit between the look and the cell
            self._seen = self._stored.value
            return self._retract() or LOOK
        if self._ready(timeout_s):
            # Taken (the cell is 0 already), or a late message: then this cell was not
            # taken and is still set. Either way the worker leaves its cell now.
            with self._wants.get_lock():
                self._wants[self.slot] = 0
            return self._receive()
        return self._retract()

    def offer(self, want: int) -> None:
        """Offer to take tasks while finishing: called just before the commit after which
        this worker wants ``want`` more (the commit's own claim looks for ready tasks
        then). An accept that commits meanwhile may claim tasks for it; ``withdraw`` after
        the commit, always. The cell is negative: ``take`` gives it tasks, never ``CLAIM``.
        The stored count is read as the last look: an accept that comes later either
        finds the cell or changes the count, and the next ``wait`` looks."""
        self._seen = self._stored.value
        with self._wants.get_lock():
            self._wants[self.slot] = -max(1, min(want, HANDOFF_MAX))

    def withdraw(self) -> Handed:
        """End an ``offer``: the handles of tasks an accept claimed for this worker
        meanwhile (or ``LOOK`` when it found none), ``None`` when no accept took it."""
        return self._retract()

    def _ready(self, timeout_s: float) -> bool:
        try:
            return bool(self._reader.poll(timeout_s))
        except (OSError, EOFError):
            return False

    def _retract(self) -> Handed:
        """Leave the idle cell; when the ingest took it first, take its message."""
        with self._wants.get_lock():
            if self._wants[self.slot] != 0:
                self._wants[self.slot] = 0
                return None
        if self._ready(RECEIVE_TIMEOUT_S):
            return self._receive()
        log.warning(
            "handoff slot %d: taken, but no message came within %.0f s",
            self.slot,
            RECEIVE_TIMEOUT_S,
        )
        return None

    def _receive(self) -> Handed:
        try:
            return _decode(self._reader.recv_bytes())
        except (OSError, EOFError, ValueError):
            return None

    def close(self) -> None:
        self._reader.close()


class Handoff:
    """The parent's side: the idle cells of all worker slots, and each slot's sending end.

    Args:
        owners: the lease owner name of each slot's worker (a replacement keeps its slot's).
    """

    def __init__(self, owners: Sequence[str]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._ctx = ctx
        self.owners = list(owners)
        self._wants = ctx.Array("i", len(self.owners))
        self._stored = ctx.Value("Q", 0)
        self._writers: list[Connection | None] = [None] * len(self.owners)
        self._lock = threading.Lock()

    def endpoint(self, slot: int) -> HandoffEndpoint:
        """A new pipe for a new process of ``slot`` (the old one's, if any, is closed); the
        caller closes the returned endpoint in this process once the child has started."""
        reader, writer = self._ctx.Pipe(duplex=False)
        with self._wants.get_lock():
            self._wants[slot] = 0
        with self._lock:
            old, self._writers[slot] = self._writers[slot], writer
        if old is not None:
            old.close()
        return HandoffEndpoint(slot, reader, self._wants, self._stored)

    def take(self, needed: int, *, finishing: bool = True) -> list[tuple[int, str, int]]:
        """Take idle workers for up to ``needed`` tasks: those that wait first, in slot
        order, then (with ``finishing``) those committing their last batch (``offer``).

        Returns:
            ``(slot, owner, n)`` per worker taken. Each must then get exactly one ``give``,
            whatever happens in between.
        """
        taken: list[tuple[int, str, int]] = []
        if needed < 1:
            return taken
        with self._wants.get_lock():
            wants = self._wants[:]
            order = [s for s, w in enumerate(wants) if w > 0]
            if finishing:
                order += [s for s, w in enumerate(wants) if w < 0]
            for slot in order:
                self._wants[slot] = 0
                n = min(abs(wants[slot]), needed)
                taken.append((slot, self.owners[slot], n))
                needed -= n
                if needed <= 0:
                    break
        return taken

    def give(self, slot: int, message: list[Handle] | Literal["look", "claim"]) -> None:
        """Send a taken worker its message. A worker that died meanwhile is only logged: its
        tasks come back when their leases expire."""
        with self._lock:
            writer = self._writers[slot]
        if writer is None:
            return
        try:
            writer.send_bytes(_encode(message))
        except (OSError, ValueError) as exc:
            log.warning(
                "handoff to worker slot %d failed (its tasks return at lease expiry): %s", slot, exc
            )

    def accept(self, tasks: TaskStore, items: Sequence[AcceptItem]) -> list[AcceptResult]:
        """The ingest's accept with the hand-off (``ingest.AcceptHandoff``): the accept
        transaction also claims the new tasks for idle workers (``take``), each taken worker
        gets its handles after the commit (``give``); tasks stored that no idle worker took
        wait for the next claim, and an idle worker that turns up meanwhile is told to
        claim (``CLAIM``).

        Raises:
            StoreBusy, StoreError: as ``TaskStore.accept_and_claim`` (every worker taken
                was told to ``LOOK`` first).
        """
        taken = self.take(len(items))
        intake = None
        try:
            intake = tasks.accept_and_claim(items, [(owner, n) for _, owner, n in taken])
        finally:
            # Every worker taken gets its one message, whatever happened.
            for i, (slot, _, _) in enumerate(taken):
                handles = intake.claimed[i] if intake is not None else []
                self.give(slot, handles or LOOK)
        stored = sum(r.outcome is Outcome.STORED for r in intake.results)
        if stored:
            self.stored()
            handed = sum(len(h) for h in intake.claimed)
            # Workers that finish a batch will claim them in that commit: only idle ones.
            for slot, _, _ in self.take(stored - handed, finishing=False):
                self.give(slot, CLAIM)
        return intake.results

    def idle(self) -> dict[int, int]:
        """The workers waiting idle now: slot -> how many tasks each wants."""
        with self._wants.get_lock():
            return {slot: want for slot, want in enumerate(self._wants[:]) if want > 0}

    def stored(self) -> None:
        """Count a commit that stored new tasks (after it, before the next ``take``)."""
        with self._stored.get_lock():
            self._stored.value += 1

    def close(self) -> None:
        with self._lock:
            writers, self._writers = self._writers, [None] * len(self.owners)
        for writer in writers:
            if writer is not None:
                writer.close()


def _encode(message: list[Handle] | Literal["look", "claim"]) -> bytes:
    """``look``, ``claim``, or ``task_id fence`` lines (no pickle: a few bytes per task)."""
    if isinstance(message, str):
        return message.encode()
    return "\n".join(f"{task_id} {fence}" for task_id, fence in message).encode()


def _decode(data: bytes) -> Handed:
    text = data.decode()
    if text == LOOK:
        return LOOK
    if text == CLAIM:
        return CLAIM
    handles: list[Handle] = []
    for line in text.split("\n") if text else ():
        task_id, _, fence = line.rpartition(" ")
        handles.append((task_id, int(fence)))
    return handles
