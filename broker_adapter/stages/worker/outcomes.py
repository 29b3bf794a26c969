"""What a worker commits for a handler's outcome: a result, or an error and whether to retry.

A result is checked against the result bounds (``bounds.check_result``) and committed as
JSON text; a result over them, or not JSON, fails the task without a retry (the handler
would return the same again). A call abandoned at its timeout or past the stop grace fails
with a retry; a raised exception fails as ``"ExcType: message"``, retried when the handler
asked for it (``handlers.is_retryable``).
"""

from __future__ import annotations

import logging
from functools import partial

from broker_adapter import crashpoints
from broker_adapter.errors import EnvelopeError, RetryableError, StaleError, TaskCancelled
from broker_adapter.protocol.bounds import check_result
from broker_adapter.stages.shared.calls import CallOutcome
from broker_adapter.stages.shared.handlers import describe_error, is_retryable
from broker_adapter.stages.worker.config import WorkerStats
from broker_adapter.store import transitions
from broker_adapter.store.settle import FailOutcome, Settlement, SettleResult
from broker_adapter.store.task_types import ClaimedTask

#: The error a task fails with when its handler's result is over the result bounds
#: (``bounds.check_result``); not retried: the handler would return as much again.
RESULT_TOO_LARGE = "result_too_large"


def settlement(
    claimed: ClaimedTask,
    outcome: CallOutcome,
    timeout_s: float,
    *,
    grace_s: float,
    stats: WorkerStats,
    log: logging.Logger,
) -> Settlement:
    """What to commit for one handler outcome (``timeout_s``: the call's timeout,
    ``grace_s``: the worker's stop grace, for the error texts); a call abandoned at its
    timeout or the stop grace is counted in ``stats.timeouts``, every failure logged."""
    fail = partial(Settlement, claimed.task_id, claimed.owner, claimed.fence, None)
    if outcome.ok:
        try:
            encoded = check_result(outcome.value).decode("utf-8")
        except EnvelopeError as exc:  # deterministic: the same result is as large again
            return fail(f"{RESULT_TOO_LARGE}: {exc.detail}", False)
        except (TypeError, ValueError, RecursionError) as exc:
            error = f"{type(exc).__name__}: the handler returned a non-JSON result: {exc}"
            return fail(error, False)
        return Settlement(claimed.task_id, claimed.owner, claimed.fence, encoded, claimed=claimed)
    if outcome.timed_out:
        stats.timeouts += 1
        error = f"TimeoutError: the handler did not return within {timeout_s:.3f} s"
        log_failure(log, claimed, error, retry=True)
        return fail(error, True)
    if outcome.stopped:
        stats.timeouts += 1
        error = f"WorkerStopping: the handler did not finish within the {grace_s} s shutdown grace"
        log_failure(log, claimed, error, retry=True)
        return fail(error, True)
    assert outcome.error is not None
    raised = outcome.error
    error, retry = describe_error(raised), is_retryable(raised)
    log_failure(log, claimed, error, retry=retry, raised=raised)
    after = getattr(raised, "retry_after_s", None) if retry else None
    if isinstance(after, int | float) and not isinstance(after, bool) and after > 0:
        return fail(error, retry, retry_after_s=float(after))
    return fail(error, retry)


def log_failure(
    log: logging.Logger,
    claimed: ClaimedTask,
    error: str,
    *,
    retry: bool,
    raised: BaseException | None = None,
) -> None:
    """Log a handler's failure with the task's ids (never its payload): a warning when
    it asks for another attempt, an error otherwise, and the traceback unless the
    handler asked for a retry on purpose (``RetryableError``)."""
    log.log(
        logging.WARNING if retry else logging.ERROR,
        "handler failed on task %s (message %s from %s, attempt %d of %d%s): %s",
        claimed.task_id,
        claimed.message_id,
        claimed.principal,
        claimed.attempt,
        claimed.max_attempts,
        ", asks for a retry" if retry else "",
        error,
        exc_info=None if raised is None or isinstance(raised, RetryableError) else raised,
        extra=transitions.claim_fields(claimed),
    )


def count_committed(
    claimed: ClaimedTask, result: SettleResult, stats: WorkerStats, log: logging.Logger
) -> None:
    """Count what the batch's commit did with one outcome: refused as cancelled or stale
    (logged), or committed (``done``, retried, ``failed``; then ``worker.after_finish``)."""
    if isinstance(result, TaskCancelled):
        note_cancelled(claimed, stats, log)
    elif isinstance(result, StaleError):
        stats.stale_commits += 1
        log.warning(
            "stale commit refused for task %s (owner %s, fence %d): %s",
            claimed.task_id,
            claimed.owner,
            claimed.fence,
            result,
        )
    else:
        if isinstance(result, FailOutcome):
            if result is FailOutcome.RETRY:
                stats.retried += 1
            else:
                stats.failed += 1
        else:
            stats.done += 1
        crashpoints.hit("worker.after_finish")


def note_cancelled(claimed: ClaimedTask, stats: WorkerStats, log: logging.Logger) -> None:
    """A task found cancelled at its commit: nothing committed, counted and logged."""
    stats.cancelled += 1
    transitions.claim_transition(
        "cancelled",
        claimed,
        "cancelled",
        detail="cancelled while its handler ran; an effect it caused stays",
    )
