"""Optional OpenTelemetry spans for the four stages a request passes: ingest, handler,
reply publication and receipt.

With ``opentelemetry-api`` installed (the ``otel`` extra) and a tracer provider configured
in the process (the SDK's, set up by the application or by ``opentelemetry-instrument``),
every request gets these spans, each parented on the request's W3C ``traceparent`` (the
envelope member, which its reply carries too), or in a trace of their own when it came
without one:

==============  ========  ==================================================================
span            kind      covers
==============  ========  ==================================================================
``ba.ingest``   consumer  one per authenticated entry: its batch, up to the accept commit
``ba.handler``  internal  one per handler call, *current* while the handler runs, so the
                          handler's own spans are its children
``ba.publish``  producer  one per reply publication attempt (dispatcher or worker)
``ba.receive``  consumer  one per verified reply the receiver applied, skipped or refused
==============  ========  ==================================================================

Attributes are ids and outcomes only (``ba.principal``, ``ba.message_id``, ``ba.task_id``,
``ba.reply_id``, ``ba.outcome``, ``ba.attempt``, ``ba.fence``, ``messaging.message.id``):
never a payload, a result or a secret. A failed outcome sets the span's status to error.

Without the package nothing here imports it, and every function returns at once. A span
that cannot be recorded is logged and dropped: tracing never stops a stage. With it
but no provider configured (the API's default proxy), no span is made either: a stage pays
one check per batch, a handler call one check per call. The ingest, publish and receive
spans are written after their batch committed, with the batch's start and end times, so
no stage holds a span open across a transaction or a Redis call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from broker_adapter.errors import EnvelopeError
from broker_adapter.protocol.canonical import loads_strict
from broker_adapter.protocol.envelope import check_traceparent

if TYPE_CHECKING:
    from broker_adapter.store.inbox import AcceptItem, AcceptResult
    from broker_adapter.store.outbox_types import OutboxRow
    from broker_adapter.store.receipts import AppliedItem, ReceiptItem

INSTRUMENTATION_NAME = "broker_adapter"
log = logging.getLogger("broker_adapter.stages.tracing")

_UNSET: Any = object()
#: ``opentelemetry.trace`` once looked for; ``None`` when it is not installed.
_api: Any = _UNSET
#: The provider last seen and the tracer made from it.
_cached: tuple[Any, Any] | None = None


def _trace_api() -> Any:
    global _api
    if _api is _UNSET:
        try:
            from opentelemetry import trace
        except ImportError:
            trace = None  # type: ignore[assignment]
        _api = trace
    return _api


def tracer() -> Any | None:
    """The tracer spans are made with, or ``None``: ``opentelemetry-api`` is not installed,
    or no tracer provider is configured."""
    global _cached
    trace = _trace_api()
    if trace is None:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    cached = _cached
    if cached is None or cached[0] is not provider:
        cached = _cached = (provider, provider.get_tracer(INSTRUMENTATION_NAME))
    return cached[1]


def now() -> int:
    """Epoch nanoseconds, the start of a span ``ingested``, ``published`` or ``received``
    writes afterwards."""
    return time.time_ns()


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """The version-00 ``traceparent`` of a span context."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def current_traceparent() -> str | None:
    """The ``traceparent`` of the span current in this thread, for an agent to send with
    its request (``Publisher.publish(envelope, traceparent=...)``); ``None`` without
    ``opentelemetry-api`` or outside any valid span."""
    trace = _trace_api()
    if trace is None:
        return None
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format_traceparent(ctx.trace_id, ctx.span_id, int(ctx.trace_flags))


def _parent(traceparent: Any) -> Any:
    """The context a span of this request is made in: the remote span ``traceparent``
    names, or ``None`` (the caller's current context) when it is absent or not valid."""
    try:
        value = check_traceparent(traceparent)
    except EnvelopeError:
        return None
    if value is None:
        return None
    trace = _api
    span_context = trace.SpanContext(
        trace_id=int(value[3:35], 16),
        span_id=int(value[36:52], 16),
        is_remote=True,
        trace_flags=trace.TraceFlags(int(value[53:55], 16)),
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context))


def _record(
    tr: Any,
    name: str,
    kind: Any,
    traceparent: Any,
    span: tuple[int, int],
    attributes: dict[str, Any],
    error: str | None,
) -> None:
    started, ended = span
    try:
        made = tr.start_span(
            name,
            context=_parent(traceparent),
            kind=kind,
            attributes=attributes,
            start_time=started,
        )
        if error is not None:
            made.set_status(_api.Status(_api.StatusCode.ERROR, error))
        made.end(end_time=ended)
    except Exception as exc:  # noqa: BLE001 - a tracing failure never stops a stage
        log.warning("tracing: %s span not recorded: %r", name, exc)


# -- the stages -------------------------------------------------------------------------------


def ingested(items: Sequence[AcceptItem], results: Sequence[AcceptResult], started: int) -> None:
    """One ``ba.ingest`` span per item of a committed accept batch (``started``: ``now()``
    before it)."""
    tr = tracer()
    if tr is None:
        return
    span = (started, time.time_ns())
    for item, result in zip(items, results, strict=True):
        env = item.envelope
        attributes: dict[str, Any] = {
            "ba.principal": item.principal,
            "ba.message_id": env.message_id,
            "ba.outcome": result.outcome.value,
        }
        if result.task_id is not None:
            attributes["ba.task_id"] = result.task_id
        if item.entry_id is not None:
            attributes["messaging.message.id"] = item.entry_id
        refusal = result.refusal
        error = None if refusal is None else refusal.reason
        if result.outcome.value == "conflict":
            error = "conflict"
        _record(tr, "ba.ingest", _api.SpanKind.CONSUMER, env.traceparent, span, attributes, error)


class _NoSpan:
    """The handler span when tracing is off: does nothing."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def ended(self, outcome: Any) -> None:
        return None


_NO_SPAN = _NoSpan()


class _HandlerSpan(_NoSpan):
    """``ba.handler``, current while the block runs."""

    __slots__ = ("_current", "_span")

    def __init__(self, tr: Any, task: Any) -> None:
        self._current = tr.start_as_current_span(
            "ba.handler",
            context=_parent(task.traceparent),
            kind=_api.SpanKind.INTERNAL,
            attributes={
                "ba.principal": task.principal,
                "ba.message_id": task.message_id,
                "ba.task_id": task.task_id,
                "ba.attempt": task.attempt,
                "ba.fence": task.fence,
            },
        )
        self._span: Any = None

    def __enter__(self) -> _HandlerSpan:
        self._span = self._current.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._current.__exit__(*exc)

    def ended(self, outcome: Any) -> None:
        """Mark the span with a ``CallOutcome``: the handler's exception, a timeout."""
        error: BaseException | None = outcome.error
        if error is not None:
            self._span.record_exception(error)
            self._span.set_status(_api.Status(_api.StatusCode.ERROR, type(error).__name__))
        elif outcome.timed_out or outcome.stopped:
            reason = "timeout" if outcome.timed_out else "stopped"
            self._span.set_status(_api.Status(_api.StatusCode.ERROR, reason))


def handler_span(task: Any) -> _NoSpan:
    """The ``ba.handler`` span of one call of ``task`` (a ``handler.task.Task``), a context
    manager; call ``ended(outcome)`` on it with the call's ``CallOutcome``."""
    tr = tracer()
    return _NO_SPAN if tr is None else _HandlerSpan(tr, task)


def _body_traceparent(body: bytes) -> Any:
    """The ``traceparent`` member of a reply body (``None`` if it has none)."""
    try:
        reply = loads_strict(body)
    except (ValueError, RecursionError):
        return None
    return reply.get("traceparent") if isinstance(reply, dict) else None


def published(rows: Sequence[OutboxRow], pubs: Sequence[Any], started: int) -> None:
    """One ``ba.publish`` span per row of a publication batch (``pubs``: its
    ``Publication`` outcomes, in order)."""
    tr = tracer()
    if tr is None:
        return
    span = (started, time.time_ns())
    for row, pub in zip(rows, pubs, strict=True):
        outcome = pub.outcome.value
        attributes: dict[str, Any] = {
            "ba.principal": row.principal,
            "ba.message_id": row.message_id,
            "ba.reply_id": row.reply_id,
            "ba.outcome": outcome,
        }
        if row.task_id is not None:
            attributes["ba.task_id"] = row.task_id
        if pub.entry_id is not None:
            attributes["messaging.message.id"] = pub.entry_id
        error = outcome if outcome in ("failed", "conflict") else None
        parent = _body_traceparent(bytes(row.body))
        _record(tr, "ba.publish", _api.SpanKind.PRODUCER, parent, span, attributes, error)


def received(items: Sequence[ReceiptItem], results: Sequence[AppliedItem], started: int) -> None:
    """One ``ba.receive`` span per verified reply of a receiver batch."""
    tr = tracer()
    if tr is None:
        return
    span = (started, time.time_ns())
    for item, result in zip(items, results, strict=True):
        body: Mapping[str, Any] = item.reply.body if item.reply is not None else {}
        outcome = "effect_failed" if result.outcome is None else result.outcome.value
        attributes: dict[str, Any] = {
            "ba.principal": item.principal,
            "ba.reply_id": item.reply_id,
            "ba.outcome": outcome,
        }
        for key in ("task_id", "message_id", "status"):
            value = body.get(key)
            if isinstance(value, str):
                attributes[f"ba.{key}"] = value
        if item.entry_id is not None:
            attributes["messaging.message.id"] = item.entry_id
        error = outcome if outcome in ("effect_failed", "conflict") else None
        parent = body.get("traceparent")
        _record(tr, "ba.receive", _api.SpanKind.CONSUMER, parent, span, attributes, error)
