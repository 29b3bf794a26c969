"""Named fault points: ``BA_CRASHPOINT=<name>[@<n>]`` SIGKILLs the process at the n-th hit.

Every point the library passes through is listed in ``POINTS`` below; a name that is not
listed is refused when the variable is read, so a typo in a test fails loudly instead of
silently never firing. ``BA_PAUSEPOINT`` works the same way but SIGSTOPs the process (a
"zombie" that a harness resumes later with SIGCONT).

SIGKILL, not ``sys.exit``: no ``finally`` block, no ``atexit`` handler, no SQLite rollback
runs, exactly as when the kernel or an operator kills the process. When neither variable is
set, ``hit()`` is a dictionary lookup and a return.
"""

from __future__ import annotations

import os
import signal
import threading

from broker_adapter.errors import ConfigError

ENV_CRASH = "BA_CRASHPOINT"
ENV_PAUSE = "BA_PAUSEPOINT"

_STORE_OPS = (
    "accept",
    "claim",
    "renew",
    "finish",
    "fail",
    "cancel",
    "reconcile",
    "outbox_claim",
    "mark_sent",
    "reply_retry",
    "reply_dead",
    "reply_replay",
    "redis_epoch",
    "receipt",
    "purge",
    # effects beyond our transaction (store/effects.py)
    "cancel_request",
    "effect_started",
    "to_unknown",
    "unknown_lapsed",
    "claim_unknown",
    "reconcile_done",
    "reconcile_not_done",
    "reconcile_unknown",
    "reconcile_operator",
    "compensation_begin",
    "compensation_end",
    "reconcile_cancelled",  # store/cancel_reconcile.py
    "operator_timeout",  # store/operator_waits.py
    "approval_grant",
    "approval_revoke",
    "approval_wait",
    "approval_release",
    "approval_use",
)

#: Every crash point, with the window it opens.
POINTS: dict[str, str] = {
    **{
        f"store.{op}.{when}": f"{when.replace('_', ' ')} of the store's {op} transaction"
        for op in _STORE_OPS
        for when in ("before_commit", "after_commit")
    },
    "ingest.after_read": "entries read from the stream, nothing committed",
    "ingest.after_commit": "inbox committed, stream entries not yet acknowledged",
    "ingest.after_xack": "entries acknowledged",
    "ingest.after_dead_letter": "bad entries moved to the dead-letter stream",
    "ingest.after_autoclaim": "idle entries of another consumer taken over",
    "ingest.after_trim": "inbound and dead-letter streams trimmed, nothing else done",
    "dispatcher.after_trim": "reply and reply dead-letter streams trimmed",
    "worker.after_claim": "task claimed (lease, fence+1), handler not started",
    "worker.after_effect": "handler returned (its side effect done), result not committed",
    "worker.after_finish": "terminal state and reply committed",
    "dispatcher.before_xadd": "reply claimed from the outbox, not yet published",
    "dispatcher.after_xadd": "reply published, not yet marked sent",
    "dispatcher.after_mark_sent": "reply marked sent",
    "receiver.before_commit": "reply read, receipt and effect not committed",
    "receiver.after_commit": "receipt and effect committed, entry not acknowledged",
    "receiver.after_xack": "reply entry acknowledged",
}


class _Armed:
    def __init__(self, name: str, nth: int, sig: signal.Signals) -> None:
        self.name = name
        self.nth = nth
        self.sig = sig
        self.hits = 0


def parse_spec(spec: str) -> tuple[str, int]:
    """Parse ``name[@n]`` into ``(name, n)``.

    Raises:
        ConfigError: the name is not a known point, or n is not a positive integer.
    """
    name, at, count = spec.strip().partition("@")
    if name not in POINTS:
        raise ConfigError(f"unknown crash point {name!r}; known: {', '.join(sorted(POINTS))}")
    if not at:
        return name, 1
    # Plain ASCII digits only: int() would also take "", " 2", "+2", "3_0" or "٣".
    if not (count.isascii() and count.isdigit()):
        raise ConfigError(f"crash point count must be a whole number, got {count!r}")
    nth = int(count)
    if nth < 1:
        raise ConfigError(f"crash point count must be >= 1, got {nth}")
    return name, nth


_lock = threading.Lock()
_armed: dict[str, _Armed] | None = None


def _load() -> dict[str, _Armed]:
    armed: dict[str, _Armed] = {}
    for env, sig in ((ENV_CRASH, signal.SIGKILL), (ENV_PAUSE, signal.SIGSTOP)):
        spec = os.environ.get(env, "")
        if spec:
            name, nth = parse_spec(spec)
            armed[name] = _Armed(name, nth, sig)
    return armed


def reset() -> None:
    """Forget counters and re-read the environment at the next hit (for tests)."""
    global _armed
    with _lock:
        _armed = None


def hit(name: str) -> None:
    """Mark that the process passed point ``name``; kill or stop it if armed for this hit."""
    global _armed
    armed = _armed
    if armed is None:
        with _lock:
            if _armed is None:
                _armed = _load()
            armed = _armed
    if not armed:
        return
    point = armed.get(name)
    if point is None:
        return
    with _lock:
        point.hits += 1
        fire = point.hits == point.nth
    if fire:
        os.kill(os.getpid(), point.sig)
