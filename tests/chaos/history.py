"""The run's history: one JSONL line per event, Jepsen style (invoke, then ok/fail/info).

Every event carries ``t`` (``time.monotonic()``, comparable across processes on one host)
and ``wall`` (``time.time()``), the process that logged it (``proc``), its ``type``
(``invoke``, ``ok``, ``fail``, ``info``), the operation ``f`` and, where there is one, the
``key`` (``<principal>:<id>``). Writers flush each line, so a SIGKILLed writer loses at most
the line it was writing; the checker never relies on history for ground truth, only for what
the agents were told (acknowledged or not) and when faults started and stopped.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

Event = dict[str, Any]

INVOKE = "invoke"
OK = "ok"
FAIL = "fail"
INFO = "info"


class History:
    """A thread-safe, line-buffered JSONL event log.

    Args:
        path: the file (appended to; created if absent).
        proc: the default ``proc`` of the events written through this object.
    """

    def __init__(self, path: Path, proc: str = "run") -> None:
        self.path = path
        self.proc = proc
        self._lock = threading.Lock()
        self._file: TextIO | None = path.open("a", encoding="utf-8", buffering=1)
        self._count = 0

    def log(
        self,
        type_: str,
        f: str,
        *,
        key: str | None = None,
        value: Any = None,
        error: str | None = None,
        proc: str | None = None,
    ) -> Event:
        """Append one event and return it.

        Args:
            type_: ``invoke``, ``ok``, ``fail`` or ``info``.
            f: the operation (``publish``, ``start``, ``stop``, ``cancel``, ...).
            key: the request key ``<principal>:<id>``, if any.
            value: any JSON value.
            error: why an operation failed or is indeterminate.
            proc: overrides the writer's default ``proc``.
        """
        event: Event = {
            "t": round(time.monotonic(), 6),
            "wall": round(time.time(), 6),
            "proc": proc or self.proc,
            "type": type_,
            "f": f,
        }
        if key is not None:
            event["key"] = key
        if value is not None:
            event["value"] = value
        if error is not None:
            event["error"] = error
        line = json.dumps(event, sort_keys=True, default=str)
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")
                self._count += 1
        return event

    @property
    def count(self) -> int:
        return self._count

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path: Path) -> Iterator[Event]:
    """The events of one JSONL file; a torn last line (writer killed mid-line) is skipped."""
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                yield event


def merge(paths: Iterable[Path]) -> list[Event]:
    """All events of several files, ordered by monotonic time (stable for ties)."""
    events: list[Event] = []
    for path in paths:
        if path.exists():
            events.extend(read_events(path))
    events.sort(key=lambda e: float(e.get("t", 0.0)))
    return events


def write_merged(events: Iterable[Event], out: Path) -> int:
    """Write ``events`` as one JSONL file; returns how many were written."""
    n = 0
    with out.open("w", encoding="utf-8") as fh:
        for event in events:
            fh.write(json.dumps(event, sort_keys=True, default=str) + "\n")
            n += 1
    return n
