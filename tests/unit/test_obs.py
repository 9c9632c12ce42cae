"""Trace ids carried from a decision's cause to what it appends."""

from __future__ import annotations

import re

import pytest

from gpuherd import obs

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
SHAPE = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


@pytest.fixture
def ids_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A configured process whose spans nobody records."""
    monkeypatch.setattr(obs, "_configured", True)
    monkeypatch.setattr(obs, "_exporting", False)


def test_a_child_continues_its_parents_trace_as_a_new_span(ids_only: None) -> None:
    child = obs.child_traceparent(PARENT, "scheduler.decide")
    assert child is not None and SHAPE.match(child)
    _, trace_id, span_id, flags = child.split("-")
    assert trace_id == PARENT.split("-")[1] and flags == "01"
    assert span_id != PARENT.split("-")[2] and span_id != "0" * 16
    assert obs.child_traceparent(PARENT, "scheduler.decide") != child, "each decision is a span of its own"


@pytest.mark.parametrize("parent", [None, "", "garbage", "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"])
def test_without_a_readable_parent_a_new_trace_begins(ids_only: None, parent: str | None) -> None:
    child = obs.child_traceparent(parent, "scheduler.decide")
    assert child is not None and SHAPE.match(child)
    assert child.split("-")[1] != "0" * 32


def test_recorded_spans_continue_the_parents_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the SDK (spans exported, or tracing never configured: then the parent passes on)."""
    monkeypatch.setattr(obs, "_exporting", True)
    child = obs.child_traceparent(PARENT, "x")
    assert child is not None and child.split("-")[1] == PARENT.split("-")[1]


def test_a_call_where_nothing_records_spans_still_sends_a_traceparent(ids_only: None) -> None:
    with obs.call_span("client.submit", source="ci") as sent:
        assert sent is not None and SHAPE.match(sent)
    with obs.call_span("client.submit", source="ci") as again:
        assert again is not None and again.split("-")[1] != sent.split("-")[1], "each call starts its own trace"


def test_a_call_inside_a_span_continues_its_trace(ids_only: None) -> None:
    with obs.span_from(PARENT, "caller"), obs.call_span("client.submit") as sent:
        assert sent is not None and sent.split("-")[1] == PARENT.split("-")[1]
        assert sent.split("-")[2] != PARENT.split("-")[2]


def test_an_exported_call_span_lasts_the_call_and_carries_its_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(obs, "_exporting", True)
    monkeypatch.setattr(obs, "tracer", lambda: provider.get_tracer("gpuherd"))
    with obs.call_span("client.submit", source="ci") as sent:
        assert not exporter.get_finished_spans(), "the span is open while the call waits"
    (span,) = exporter.get_finished_spans()
    assert span.name == "client.submit" and span.attributes == {"source": "ci"}
    assert sent is not None and sent.split("-")[1] == format(span.context.trace_id, "032x")
    assert sent.split("-")[2] == format(span.context.span_id, "016x")
