"""The log format of the long-running commands: ``--log-format text|json`` (``run``,
``receive``; env ``BA_LOG_FORMAT``).

Both formats render a record's structured fields, the attributes a call gave with
``extra=`` (the task transition lines of ``store.transitions``, a handler failure's ids):
``text`` appends them as ``key=value``, ``json`` makes them members of the line's object.
A record forwarded from a worker process (``app.logforward``) arrives with its message
already built and its traceback as text, its fields kept: it renders as its own.

One JSON object per line::

    {"ts": "2026-12-01T17:02:03.123Z", "level": "INFO", "logger": "broker_adapter.tasks",
     "message": "task 0193… retry", "transition": "retry", "task_id": "0193…", ...}

with ``exc`` holding a traceback when there is one. Built on the standard library only.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import unicodedata
from typing import Any, Literal

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: The attributes every ``LogRecord`` has; any other is a field given with ``extra=``.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The record's structured fields, in the order they were given."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


#: Unicode format characters (Cf: bidirectional overrides such as U+202E, zero-width
#: characters) and line/paragraph separators (Zl, Zp): text from input holding them would
#: reorder or split a log line as a reader sees it, so both formats write them as ``\uXXXX``.
_INVISIBLE = frozenset({"Cf", "Zl", "Zp"})


def escape_invisible(text: str) -> str:
    """``text`` with every format and line/paragraph separator character written as a JSON
    escape, ``\\uXXXX`` (a surrogate pair beyond the BMP), so that a JSON line stays valid
    JSON; ASCII text is returned as it is."""
    if text.isascii():
        return text
    return "".join(_escaped(c) if unicodedata.category(c) in _INVISIBLE else c for c in text)


def _escaped(char: str) -> str:
    code = ord(char)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _plain(value: Any) -> Any:
    return value if isinstance(value, str | int | float | bool) or value is None else str(value)


class TextFormatter(logging.Formatter):
    """The classic line, then `` key=value`` per field (a value with a space quoted)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        extra = fields_of(record)
        if extra:
            line += "".join(f" {k}={_text_value(v)}" for k, v in extra.items())
        return escape_invisible(line)


def _text_value(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if not text or any(c.isspace() or c in '"=' for c in text) else text


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (UTC, ISO 8601, milliseconds), ``level``,
    ``logger``, ``message``, the fields, and ``exc`` (a traceback) or ``stack``."""

    def format(self, record: logging.LogRecord) -> str:
        ms = int(record.msecs)
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{ms:03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for k, v in fields_of(record).items():
            out.setdefault(k, _plain(v))
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return escape_invisible(json.dumps(out, ensure_ascii=False, default=str))


def formatter(log_format: LogFormat) -> logging.Formatter:
    return JsonFormatter() if log_format == "json" else TextFormatter()


def configure(level: int, log_format: LogFormat = "text") -> None:
    """Log to stderr at ``level`` in ``log_format``, as ``logging.basicConfig`` does: a
    root logger that has handlers already (an embedding program's) is left alone."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format))
    logging.basicConfig(level=level, handlers=[handler])
