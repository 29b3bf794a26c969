"""SIGTERM and SIGINT ask a process to stop: ``stop_on_signals`` makes them set its stop
event, for ``broker-adapter run`` and ``receive``, each worker child and
``Adapter.run_forever``. What stopping means (claim nothing more, drain, exit 0) is the
stop event's reader's business."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType

#: The signals that ask a process to drain and stop.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_on_signals(stop: threading.Event) -> Callable[[], None]:
    """From now on each of ``STOP_SIGNALS`` sets ``stop`` (call it from the main thread);
    returns what puts their previous handlers back."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
