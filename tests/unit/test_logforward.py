"""A spawned child's log records reach the parent's logging, traceback included, once."""

from __future__ import annotations

import logging
import multiprocessing
from multiprocessing.connection import Connection

import pytest

from broker_adapter.app.logforward import ChildLogs, forward_to_parent


def _child(conn: Connection, level: int) -> None:
    forward_to_parent(conn, level)
    log = logging.getLogger("broker_adapter.test_child")
    log.debug("below the parent's level: not sent")
    try:
        raise KeyError("from the child")
    except KeyError:
        log.exception("child failed on task %s", "t-1")


def test_a_child_logs_through_the_parent(caplog: pytest.LogCaptureFixture) -> None:
    ctx = multiprocessing.get_context("spawn")
    caplog.set_level(logging.INFO)
    logs = ChildLogs(ctx)
    conn = logs.pipe()
    proc = ctx.Process(target=_child, args=(conn, logs.level))
    proc.start()
    conn.close()
    proc.join(60)
    assert proc.exitcode == 0
    logs.close()
    logs.close()  # a second close does nothing
    records = [r for r in caplog.records if r.name == "broker_adapter.test_child"]
    assert len(records) == 1
    text = records[0].getMessage()
    assert text.startswith("child failed on task t-1\nTraceback (most recent call last)")
    assert text.count("Traceback") == 1
    assert "KeyError: 'from the child'" in text
    assert records[0].levelno == logging.ERROR
