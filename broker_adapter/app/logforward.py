"""Log records of worker processes, forwarded to the process that started them.

A spawned child starts with no logging set up: its warnings and its handlers' tracebacks
would go nowhere. Each child logs through a stdlib ``QueueHandler`` (``forward_to_parent``)
whose queue is a one-way pipe to the parent; in the parent one ``QueueListener`` thread
reads every child's pipe (``ChildLogs``) and hands each record to the logger of its name,
so the parent's handlers, format and levels apply to it as to its own records.

One pipe per child, not one ``multiprocessing.Queue`` for all: a queue's writers share a
lock, and a child SIGKILLed (or SIGSTOPped) while it holds that lock would silence every
other child for good. A pipe has one writer; a dead child's pipe reads as closed and is
dropped. A record is made plain in the child (``_Forwarding.prepare``: its message built,
its traceback as text in ``exc_text``, its ``extra=`` fields kept), so nothing unpicklable
crosses, and the parent's formatter, text or JSON, renders it as one of its own.
"""

from __future__ import annotations

import copy
import logging
import threading
from logging.handlers import QueueHandler, QueueListener
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext

#: How often the listener looks again when no child wrote (new pipes, a stop).
LISTEN_POLL_S = 0.2


class _PipeQueue:
    """The child's end as a ``QueueHandler`` queue. Writes are serialized by the handler's
    lock; a parent that is gone drops the record (the child dies with it)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def put_nowait(self, record: logging.LogRecord) -> None:
        try:
            self._conn.send(record)
        except OSError:
            pass


class _Forwarding(QueueHandler):
    """``QueueHandler`` whose records keep their traceback apart from the message (the
    stdlib's ``prepare`` folds it into the message text)."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        plain = copy.copy(record)
        plain.msg = record.getMessage()
        plain.args = None
        if record.exc_info:
            plain.exc_text = record.exc_text or _TRACEBACKS.formatException(record.exc_info)
        if record.stack_info:
            plain.stack_info = _TRACEBACKS.formatStack(record.stack_info)
        plain.exc_info = None
        plain.message = plain.msg
        return plain


_TRACEBACKS = logging.Formatter()


def forward_to_parent(conn: Connection, level: int) -> None:
    """In a child: send every log record of ``level`` or above to the parent's
    ``ChildLogs`` through ``conn`` (its ``pipe()``), instead of any other handler."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(_Forwarding(_PipeQueue(conn)))  # type: ignore[arg-type]
    root.setLevel(level)


class _Replay(logging.Handler):
    """Hands a child's record to this process's logger of the same name."""

    def emit(self, record: logging.LogRecord) -> None:
        logger = logging.getLogger(record.name)
        if logger.isEnabledFor(record.levelno):
            logger.handle(record)


class ChildLogs:
    """The parent's side: one ``QueueListener`` over the pipes of all children.

    Args:
        ctx: the multiprocessing context the children are started with.

    Attributes:
        level: the level children forward from (this process's root level when built).
    """

    def __init__(self, ctx: SpawnContext) -> None:
        self._ctx = ctx
        self.level = logging.getLogger().getEffectiveLevel()
        self._readers: list[Connection] = []
        self._lock = threading.Lock()
        self._closing = False
        self._listener = QueueListener(self, _Replay())
        self._started = False

    def pipe(self) -> Connection:
        """A new child's writing end (give it to ``forward_to_parent`` in the child, then
        close this process's copy once the child has started). Starts the listener."""
        reader, writer = self._ctx.Pipe(duplex=False)
        with self._lock:
            self._readers.append(reader)
            if not self._started:
                self._started = True
                self._listener.start()
        return writer

    # -- the queue ``QueueListener`` reads ---------------------------------------------

    def get(self, block: bool = True) -> logging.LogRecord | None:
        """The next record of any child; ``None`` (the listener's sentinel) once closing
        and every pipe is drained."""
        while True:
            with self._lock:
                readers = list(self._readers)
                closing = self._closing
            ready = wait(readers, timeout=0 if closing else LISTEN_POLL_S)
            if not ready and closing:
                return None
            for conn in ready:
                assert isinstance(conn, Connection)
                try:
                    record: logging.LogRecord = conn.recv()
                except (EOFError, OSError):  # that child is gone: its pipe too
                    self._drop(conn)
                    continue
                return record

    def put_nowait(self, item: object) -> None:
        """Only the listener's stop uses it (its sentinel): drain, then end."""
        with self._lock:
            self._closing = True

    def _drop(self, conn: Connection) -> None:
        with self._lock:
            if conn in self._readers:
                self._readers.remove(conn)
        conn.close()

    def close(self) -> None:
        """Forward what the children wrote, stop the listener, close the pipes (after the
        children have exited). A second call does nothing; a later ``pipe()`` starts a
        new listener."""
        with self._lock:
            started, self._started = self._started, False
        if started:
            self._listener.stop()
            self._closing = False
        with self._lock:
            readers, self._readers = self._readers, []
        for conn in readers:
            conn.close()
