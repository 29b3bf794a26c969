"""Tracing end to end on a real redis-server: a request's ``traceparent`` is carried into
its reply, and with OpenTelemetry (the SDK's in-memory exporter here) the ingest, handler,
publish and receive spans are children of it; without OpenTelemetry nothing imports it and
the reply is the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from broker_adapter.clock import FakeClock
from broker_adapter.handler.task import Task
from broker_adapter.stages.shared import tracing
from broker_adapter.stages.shared.calls import call_handler
from broker_adapter.store.task_types import ClaimedTask
from tests.support.redis_server import RedisServer
from tests.support.replies_script import REPO_ROOT
from tests.support.tracing_script import PAYLOAD_MARKER, echo, run_pipeline

pytestmark = pytest.mark.integration

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SENDER_SPAN = "00f067aa0ba902b7"
TP = f"00-{TRACE_ID}-{SENDER_SPAN}-01"
RESEND_SPAN = "b7ad6b7169203331"
STAGES = ("ba.ingest", "ba.handler", "ba.publish", "ba.receive")


@pytest.fixture
def provider(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """An SDK tracer provider with an in-memory exporter, as the process's provider for
    one test (the API allows setting the global one only once per process)."""
    exporter = InMemorySpanExporter()
    sdk = TracerProvider()
    sdk.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: sdk)
    yield sdk, exporter
    sdk.shutdown()


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


def _parent_ids(span: ReadableSpan) -> tuple[str, str]:
    assert span.parent is not None, span.name
    return f"{span.parent.trace_id:032x}", f"{span.parent.span_id:016x}"


def test_stage_spans_are_children_of_the_envelopes_traceparent(
    redis_server: RedisServer,
    prefix: str,
    tmp_path: Path,
    provider: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    sdk, exporter = provider
    inner: list[str | None] = []

    def handler(task: Task) -> dict[str, Any]:
        inner.append(tracing.current_traceparent())
        with sdk.get_tracer("test").start_as_current_span("handler.own"):
            pass
        return echo(task)

    resend = f"00-{TRACE_ID}-{RESEND_SPAN}-01"
    bodies = run_pipeline(redis_server.url, prefix, tmp_path, [TP, resend], handler)

    # the reply carries the request's traceparent (the first copy's: the resend in another
    # span is a duplicate of it, not a conflict)
    assert [(b["status"], b["traceparent"]) for b in bodies] == [("done", TP)]
    spans = _by_name(exporter.get_finished_spans())
    assert sorted(spans) == sorted([*STAGES, "handler.own"])
    ingests = spans["ba.ingest"]
    assert sorted(str(dict(s.attributes or {})["ba.outcome"]) for s in ingests) == [
        "duplicate",
        "stored",
    ]
    assert sorted(_parent_ids(s)[1] for s in ingests) == sorted([SENDER_SPAN, RESEND_SPAN])
    for name in STAGES[1:]:
        (span,) = spans[name]
        assert _parent_ids(span) == (TRACE_ID, SENDER_SPAN), name
        assert span.parent is not None
        assert span.parent.is_remote
        assert span.status.is_ok, name
    (handled,) = spans["ba.handler"]
    handled_ctx = handled.get_span_context()
    assert handled_ctx is not None
    # the handler's own spans nest under the handler span
    (own,) = spans["handler.own"]
    assert own.parent is not None
    assert own.parent.span_id == handled_ctx.span_id
    assert inner == [tracing.format_traceparent(handled_ctx.trace_id, handled_ctx.span_id, 1)]
    assert handled.attributes is not None
    assert (handled.attributes["ba.attempt"], handled.attributes["ba.fence"]) == (1, 1)
    (published,) = spans["ba.publish"]
    (received,) = spans["ba.receive"]
    assert published.attributes is not None
    assert received.attributes is not None
    assert published.attributes["ba.outcome"] == "published"
    assert received.attributes["ba.outcome"] == "applied"
    assert received.attributes["ba.reply_id"] == bodies[0]["reply_id"]
    # ids and outcomes only: the payload (and so the result echoing it) never reaches a span
    for span in exporter.get_finished_spans():
        assert PAYLOAD_MARKER not in json.dumps(dict(span.attributes or {})), span.name


def test_a_request_without_traceparent_gets_spans_of_a_new_trace(
    redis_server: RedisServer,
    prefix: str,
    tmp_path: Path,
    provider: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    _, exporter = provider
    bodies = run_pipeline(redis_server.url, prefix, tmp_path, [None])
    assert [b["status"] for b in bodies] == ["done"]
    assert "traceparent" not in bodies[0]
    spans = _by_name(exporter.get_finished_spans())
    assert sorted(spans) == sorted(STAGES)
    assert all(s.parent is None for group in spans.values() for s in group)


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_handlers_own_spans_nest_under_its_span(
    provider: tuple[TracerProvider, InMemorySpanExporter], is_async: bool
) -> None:
    """Also for an ``async def`` handler, which runs on an event loop of its own."""
    sdk, exporter = provider
    clock = FakeClock()
    claimed = ClaimedTask(
        "t" * 32,
        "alice",
        "m1",
        "task",
        {},
        1,
        3,
        1,
        "w1",
        clock.now() + 30,
        clock.now() + 600,
        0,
        None,
        None,
        traceparent=TP,
    )

    def sync_handler(task: Task) -> str:
        with sdk.get_tracer("test").start_as_current_span("handler.own"):
            return "ok"

    async def async_handler(task: Task) -> str:
        return sync_handler(task)

    handler = async_handler if is_async else sync_handler
    outcome = call_handler(handler, Task(claimed, clock=clock), 10.0)
    assert (outcome.ok, outcome.value) == (True, "ok")
    spans = _by_name(exporter.get_finished_spans())
    (handled,) = spans["ba.handler"]
    (own,) = spans["handler.own"]
    assert _parent_ids(handled) == (TRACE_ID, SENDER_SPAN)
    handled_ctx = handled.get_span_context()
    assert handled_ctx is not None
    assert own.parent is not None
    assert own.parent.span_id == handled_ctx.span_id


def test_a_failing_handler_marks_its_span(
    redis_server: RedisServer,
    prefix: str,
    tmp_path: Path,
    provider: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    _, exporter = provider

    def broken(task: Task) -> None:
        raise ValueError("no good")

    bodies = run_pipeline(redis_server.url, prefix, tmp_path, [TP], broken)
    assert [(b["status"], b["traceparent"]) for b in bodies] == [("failed", TP)]
    (span,) = _by_name(exporter.get_finished_spans())["ba.handler"]
    assert not span.status.is_ok
    assert span.status.description == "ValueError"
    assert [e.name for e in span.events] == ["exception"]


#: An interpreter without OpenTelemetry: ``opentelemetry`` made unimportable before anything
#: else is imported (redis-py looks for it too), then the pipeline script.
_WITHOUT_OTEL = (
    "import runpy, sys; sys.modules['opentelemetry'] = None; "
    "runpy.run_module('tests.support.tracing_script', run_name='__main__')"
)


def test_without_opentelemetry_nothing_changes(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """No span, no module of it loaded, and the reply still carries the traceparent."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            _WITHOUT_OTEL,
            "--url",
            redis_server.url,
            "--prefix",
            prefix,
            "--dir",
            str(tmp_path),
            "--traceparent",
            TP,
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert (out["traced"], out["otel_modules"]) == (False, [])
    assert [(b["status"], b["traceparent"]) for b in out["bodies"]] == [("done", TP)]


def test_with_opentelemetry_but_no_provider_no_span_is_made(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """The API installed, no SDK configured (its default proxy provider): ``tracer()``
    finds nothing to make spans with, so the stages pay one check and make none."""
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert tracing.tracer() is None
    assert tracing.handler_span(object()) is tracing.handler_span(object())
    bodies = run_pipeline(redis_server.url, prefix, tmp_path, [TP])
    assert [(b["status"], b["traceparent"]) for b in bodies] == [("done", TP)]
