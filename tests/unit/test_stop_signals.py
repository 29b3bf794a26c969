"""``stop_on_signals``: SIGTERM and SIGINT set the stop event; the previous handlers come back."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from broker_adapter.app.stop_signals import STOP_SIGNALS, stop_on_signals


@pytest.mark.parametrize("sig", STOP_SIGNALS)
def test_a_stop_signal_sets_the_event_and_restore_puts_the_previous_handler_back(
    sig: signal.Signals,
) -> None:
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    stop = threading.Event()
    restore = stop_on_signals(stop)
    try:
        os.kill(os.getpid(), sig)  # the handler runs in this (the main) thread as kill returns
        assert stop.is_set()
    finally:
        restore()
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before
