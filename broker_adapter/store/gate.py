"""A queue in front of SQLite's write lock, shared by the processes of one ``run``.

SQLite never blocks on its write lock: a writer that finds it taken has to try again
later (``Database._begin_immediate`` retries every 0.05 to 0.5 ms). Polling is unfair and
slow to notice: a writer that arrives just as the lock frees takes it before one that has
waited through several tries, and a freed lock idles until the next try of whoever
waits; under load the waits, not the commits, make the latency's tail (bench/RESULTS.md).

``WriteGate`` is a process-shared lock (a POSIX semaphore) that the writers of one
database file in the processes of one pool take around their transaction: a writer
waits in the kernel and is woken the moment the previous one releases it. It only
orders writers: SQLite's lock still decides who writes, so the gate is advisory and
every fault falls back to plain polling:

* a holder killed inside its transaction cannot release the gate; the next waiter finds
  the holder's pid dead (or a zombie) after ``CHECK_S`` and releases it for it;
* a holder stopped (SIGSTOP) keeps it: the waiters give up on the gate at their busy
  deadline and meet SQLite's lock, held by the same stopped process: ``StoreBusy``, as
  without a gate;
* writers without the gate (another process, an operator's command) simply compete for
  SQLite's lock as before.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any, Final

#: How long a waiter sleeps on the gate before it checks that the holder is alive.
CHECK_S: Final = 0.05


class WriteGate:
    """Made in the parent of a pool (``multiprocessing`` spawn context) and passed to its
    children at spawn; each process gives it to its ``Database`` of that file."""

    def __init__(self, ctx: Any | None = None) -> None:
        ctx = ctx or multiprocessing.get_context("spawn")
        self._sem = ctx.Lock()
        #: pid of the holder, 0 when free or not yet known; written without a lock: a torn
        #: view only delays or hastens a check, never lets a write skip SQLite's lock.
        self._holder = ctx.Value("i", 0, lock=False)

    def enter(self, deadline: float) -> bool:
        """Wait for the gate until ``deadline`` (``time.monotonic()``).

        Returns:
            whether this process holds it now (then ``leave`` once the transaction ends);
            ``False`` at the deadline: write without it.
        """
        me = os.getpid()
        unknown = 0
        while True:
            wait = min(CHECK_S, deadline - time.monotonic())
            if wait <= 0:
                return self._sem.acquire(False) and self._took(me)
            if self._sem.acquire(True, wait):
                return self._took(me)
            holder = self._holder.value
            if holder != 0:
                unknown = 0
                if not _alive(holder):
                    self._release_for(holder)
                continue
            # Taken, holder not known: between its acquire and its pid, or killed there.
            # Twice in a row, CHECK_S apart, is no longer that window.
            unknown += 1
            if unknown >= 2:
                self._release_for(0)
                unknown = 0

    def leave(self) -> None:
        """Release the gate if this process holds it: after an ``enter`` that took it. A
        no-op when it did not, or when a waiter released it for us because we looked dead
        (a process must not have two threads between ``enter`` and ``leave``)."""
        if self._holder.value == os.getpid():
            self._holder.value = 0
            self._release()

    def _took(self, me: int) -> bool:
        self._holder.value = me
        return True

    def _release_for(self, holder: int) -> None:
        if self._holder.value == holder:
            self._holder.value = 0
            self._release()

    def _release(self) -> None:
        try:
            self._sem.release()
        except ValueError:  # already free: someone released it for a holder that lived
            pass


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    if _PROC:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except FileNotFoundError:
            return False
        except OSError:
            pass
        else:
            # "pid (comm) S ...": the state follows the last ')'; comm may hold anything.
            end = stat.rfind(b")")
            return stat[end + 2 : end + 3] not in (b"Z", b"X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_PROC: Final = os.path.isdir("/proc/self")
