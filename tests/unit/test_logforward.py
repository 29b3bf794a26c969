"""A spawned child's log records reach the parent's logging, traceback included, once, and
with their structured fields."""

from __future__ import annotations

import json
import logging
import multiprocessing
from multiprocessing.connection import Connection

import pytest

from broker_adapter.app.logforward import ChildLogs, forward_to_parent
from broker_adapter.app.logs import JsonFormatter, TextFormatter


def _child(conn: Connection, level: int) -> None:
    forward_to_parent(conn, level)
    log = logging.getLogger("broker_adapter.test_child")
    log.debug("below the parent's level: not sent")
    try:
        raise KeyError("from the child")
    except KeyError:
        log.exception("child failed on task %s", "t-1", extra={"task_id": "t-1", "fence": 3})


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
    record = records[0]
    assert record.getMessage() == "child failed on task t-1"  # the traceback kept apart
    text = TextFormatter().format(record)
    assert text.count("Traceback (most recent call last)") == 1
    assert "KeyError: 'from the child'" in text
    assert "task_id=t-1 fence=3" in text
    assert record.levelno == logging.ERROR
    line = json.loads(JsonFormatter().format(record))
    assert (line["message"], line["task_id"], line["fence"]) == (
        "child failed on task t-1",
        "t-1",
        3,
    )
    assert line["exc"].count("Traceback (most recent call last)") == 1
