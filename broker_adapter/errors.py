"""The whole error tree of broker_adapter, sorted by what the caller does next.

* ``ConfigError``: fix the configuration; nothing ran.
* ``EnvelopeError``: poison input; dead-letter it with the reason, then acknowledge it.
* ``TransientError``: retry later (Redis unreachable, SQLite busy).
* ``StaleError``: a fenced write was refused; stop and write nothing.
* ``StageError``: a stage of a running adapter stopped on an unexpected error.
* ``RetryableError``: raised by a handler (not by the library) to ask for another attempt.
* ``RequestError``: a request a ``Client`` awaited ended without a result (its ``Reply``
  says why); ``RequestTimeout``: no reply came in time (the request stays valid).

A duplicate is an outcome (a returned enum value), never an exception.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from broker_adapter.protocol.reply import Reply


class BrokerAdapterError(Exception):
    """Root of every error this library raises on purpose."""


class ConfigError(BrokerAdapterError, ValueError):
    """A configuration value is missing, malformed or inconsistent."""


class EnvelopeError(BrokerAdapterError, ValueError):
    """An envelope (or the stream entry that carries it) is invalid.

    Attributes:
        field: the envelope field at fault (``""`` when the whole entry is at fault).
        reason: a short machine-readable reason code, e.g. ``"too_long"``.
        detail: the human-readable explanation.
    """

    def __init__(self, field: str, reason: str, detail: str) -> None:
        self.field = field
        self.reason = reason
        self.detail = detail
        where = f"{field}: " if field else ""
        super().__init__(f"{where}{detail} [{reason}]")


class AuthError(EnvelopeError):
    """The entry's signature, key id or principal could not be verified."""


class TransientError(BrokerAdapterError):
    """A failure that may go away by itself; safe to retry with backoff."""


class RedisUnavailable(TransientError):
    """Redis could not be reached or timed out. A write may or may not have happened."""


class StoreBusy(TransientError):
    """SQLite stayed locked past the busy timeout."""


class StoreError(BrokerAdapterError):
    """The SQLite database is unusable (corrupt, newer schema, disk full)."""


class GroupMissingError(BrokerAdapterError):
    """The consumer group (or its stream) no longer exists in Redis."""


class StaleError(BrokerAdapterError):
    """A fenced write was refused: the caller no longer holds what it thinks it holds.

    Attributes:
        task_id: the task or reply the write was for.
        reason: why it was refused (``"fence"``, ``"owner"``, ``"lease_expired"``,
            ``"deadline"``, ``"not_running"``, ``"cancelled"``).
    """

    def __init__(self, task_id: str, reason: str, detail: str = "") -> None:
        self.task_id = task_id
        self.reason = reason
        msg = f"stale write refused for {task_id}: {reason}"
        super().__init__(f"{msg} ({detail})" if detail else msg)


class FencedError(StaleError):
    """The fencing token presented is lower than the current one."""

    def __init__(self, task_id: str, token: int, current: int) -> None:
        self.token = token
        self.current = current
        super().__init__(task_id, "fence", f"token {token}, current {current}")


class TaskCancelled(StaleError):
    """The task was cancelled while the caller held its lease."""

    def __init__(self, task_id: str) -> None:
        super().__init__(task_id, "cancelled")


class StageError(BrokerAdapterError):
    """A stage of a running adapter (ingest, dispatcher) stopped on an error that is not
    one of this tree's: a runtime failure, not a configuration one.

    Attributes:
        stage: the stage's name.
        error: what it stopped on.
    """

    def __init__(self, stage: str, error: BaseException) -> None:
        self.stage = stage
        self.error = error
        super().__init__(f"{stage} stopped: {type(error).__name__}: {error}")


class RetryableError(BrokerAdapterError):
    """Raise from a handler to ask for another attempt.

    The store decides whether there is one (attempt budget, backoff, deadline). Any other
    exception class with a class or instance attribute ``retryable = True`` counts too.

    Args:
        retry_after_s: the earliest the next attempt may start, seconds from now (a
            target's ``429`` or ``503`` with ``Retry-After``): the retry waits the larger of
            it and the backoff, and none follows when that lands at or past the deadline or
            no attempt is left. ``None``: the backoff alone.

    Raises:
        ValueError: ``retry_after_s`` is negative or not a finite number.
    """

    retryable = True

    def __init__(self, *args: object, retry_after_s: float | None = None) -> None:
        super().__init__(*args)
        if retry_after_s is not None and not 0 <= float(retry_after_s) < float("inf"):
            raise ValueError(f"retry_after_s must be a finite number >= 0, got {retry_after_s!r}")
        self.retry_after_s = None if retry_after_s is None else float(retry_after_s)


class ReplyConflict(BrokerAdapterError):
    """A reply id was seen before with a different content hash."""

    def __init__(self, reply_id: str, stored_hash: str, new_hash: str) -> None:
        self.reply_id = reply_id
        self.stored_hash = stored_hash
        self.new_hash = new_hash
        super().__init__(
            f"reply {reply_id} conflicts: stored hash {stored_hash[:12]}, got {new_hash[:12]}"
        )


class RequestError(BrokerAdapterError):
    """A request awaited with ``Client.request`` was answered without a result.

    Attributes:
        reply: the verified reply (its ``status`` and ``error`` say why).
        message_id: the request's message id.
    """

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.message_id = reply.message_id
        super().__init__(
            f"request {reply.message_id!r} ended {reply.status}: {reply.error or 'no detail'}"
        )


class RequestFailed(RequestError):
    """The task ended ``failed`` (handler error, attempts spent, refused)."""


class RequestExpired(RequestError):
    """The task's deadline passed before it ended (status ``expired``)."""


class RequestHopLimit(RequestError):
    """The request's chain went past the hop or chain limit (status ``hop_limit``)."""


class RequestCancelled(RequestError):
    """The task was cancelled (by the requester, over the wire, or by an operator)."""


class RequestConflict(RequestError):
    """The message id was used before with other content (status ``conflict``): the reply
    names the stored task; the request was not run."""


class RequestTimeout(BrokerAdapterError, TimeoutError):
    """No reply came within the request's ``timeout_s``. The request stays valid: its reply
    can still be collected later with ``Client.result(message_id)``.

    Attributes:
        message_id: the request's message id.
    """

    def __init__(self, message_id: str, timeout_s: float) -> None:
        self.message_id = message_id
        self.timeout_s = timeout_s
        super().__init__(
            f"no reply to request {message_id!r} within {timeout_s:g} s (still valid:"
            " collect it later with result())"
        )
