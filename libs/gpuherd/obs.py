"""Observability: structlog JSON logs and OpenTelemetry spans carried in message headers.

The trace context travels as a W3C ``traceparent`` header on intake
messages and on every event appended because of them, so one trace runs
from a submission through its placement to the job's start on an agent.
Logs carry ``trace_id`` and ``span_id`` of the current span.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
_configured = False
_exporting = False  # a span processor records this process's spans
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-[0-9a-f]{16}-([0-9a-f]{2})$")


def _add_trace_ids(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    span = trace.get_current_span()
    ctx = span.get_span_context()
    if ctx.is_valid:
        event_dict["trace_id"] = format(ctx.trace_id, "032x")
        event_dict["span_id"] = format(ctx.span_id, "016x")
    return event_dict


def configure(
    service: str, *, level: str | None = None, json: bool = True, exporter: SpanExporter | None = None
) -> None:
    """Set up logging and tracing for one process. Safe to call more than once."""
    global _configured, _exporting
    level_name = (level or os.environ.get("GPUHERD_LOG_LEVEL", "INFO")).upper()
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_ids,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)
    if not _configured:
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        if exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
            _exporting = True
        elif os.environ.get("GPUHERD_TRACE_CONSOLE"):
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
            _exporting = True
        trace.set_tracer_provider(provider)
        _configured = True


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


@functools.cache
def tracer() -> trace.Tracer:
    """gpuherd's tracer, made once: ``get_tracer`` builds a new one on every call (a twentieth of a
    busy submitter's time). Made before ``configure``, it is OpenTelemetry's proxy, which hands on
    to the provider set later."""
    return trace.get_tracer("gpuherd")


def current_traceparent() -> str | None:
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent")


@contextmanager
def span_from(traceparent: str | None, name: str, **attributes: Any) -> Iterator[trace.Span]:
    """Start a span whose parent is the context in ``traceparent`` (a root span if None)."""
    parent = _propagator.extract({"traceparent": traceparent}) if traceparent else otel_context.Context()
    with tracer().start_as_current_span(name, context=parent, attributes=attributes) as span:
        yield span


@contextmanager
def call_span(name: str, **attributes: Any) -> Iterator[str | None]:
    """A span around a call that waits on others (a submission awaiting its verdict), as the
    ``traceparent`` to send with it. Where spans are exported it is a recorded SDK span that lasts
    the call; where nothing records them only its ids are made, as in ``child_traceparent``."""
    if _exporting or not _configured:
        with tracer().start_as_current_span(name, attributes=attributes):
            yield current_traceparent()
        return
    yield child_traceparent(current_traceparent(), name)


def child_traceparent(traceparent: str | None, name: str, **attributes: Any) -> str | None:
    """The ``traceparent`` of a new span ``name``, child of ``traceparent`` (a new trace if None),
    for what a decision appends. Where spans are exported it is a recorded SDK span; where nothing
    records them only its ids are made (the SDK's span machinery, once per decision, was a tenth of
    a busy scheduler's time). A process that never configured tracing passes ``traceparent`` on."""
    if _exporting or not _configured:
        with span_from(traceparent, name, **attributes) as span:
            return current_traceparent() if span.get_span_context().is_valid else traceparent
    match = _TRACEPARENT.match(traceparent) if traceparent else None
    trace_id = match.group(1) if match else f"{random.getrandbits(128):032x}"
    flags = match.group(2) if match else "01"
    return f"00-{trace_id}-{random.getrandbits(64) or 1:016x}-{flags}"
