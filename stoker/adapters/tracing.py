"""OpenTelemetry tracing: one trace per job, from the API request through every Celery task to the model.

Context travels in Celery's message headers (opentelemetry-instrumentation-celery) and, for the inference batch
(which serves many jobs at once), in the job record. Exporter from settings: `none` (default), `console`, `otlp`
(OTEL_EXPORTER_OTLP_ENDPOINT, HTTP) or `file` (JSON lines, one span per line: tests and debugging).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Span, Status, StatusCode

_configured: dict[str, int] = {}
_lock = threading.Lock()


class JsonLinesExporter(SpanExporter):
    """Appends each finished span as one JSON line to a file shared by every process."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Write the spans (one O_APPEND write per span, so processes do not interleave)."""
        with self.path.open("a", encoding="utf-8") as handle:
            for span in spans:
                handle.write(json.dumps(json.loads(span.to_json())) + "\n")
                handle.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing held open."""


def setup_tracing(service: str, exporter: str, file: Path | None = None) -> bool:
    """Install the tracer provider for this process (once per process; a forked child gets its own)."""
    if exporter == "none":
        return False
    with _lock:
        if _configured.get(service) == os.getpid():
            return True
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        if exporter == "file":
            provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(file or Path("stoker-spans.jsonl"))))
        elif exporter == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        else:
            # Only a process that exports over OTLP pays for loading the exporter (protobuf, requests).
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        _configured[service] = os.getpid()
    return True


def instrument_celery() -> None:
    """Propagate trace context through Celery message headers, with a span per task run."""
    from opentelemetry.instrumentation.celery import CeleryInstrumentor  # only when tracing is on

    instrumentor = CeleryInstrumentor()  # type: ignore[no-untyped-call]
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument()


tracer = trace.get_tracer("stoker")


def carrier() -> dict[str, str]:
    """The current trace context, as a W3C traceparent carrier to store with the job."""
    headers: dict[str, str] = {}
    inject(headers)
    return headers


def trace_id_hex(span: Span) -> str | None:
    """The span's trace id as 32 hex digits, or None when tracing is off."""
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


@contextlib.contextmanager
def stage_span(name: str, attributes: Mapping[str, Any], parent: Mapping[str, str] | None = None) -> Iterator[Span]:
    """A span for one stage; under `parent` (a stored carrier) when given, else under the current span."""
    token = otel_context.attach(extract(dict(parent))) if parent else None
    try:
        with tracer.start_as_current_span(f"stage {name}", attributes={"stoker.stage": name, **attributes}) as span:
            yield span
    finally:
        if token is not None:
            otel_context.detach(token)


def mark_failed(span: Span, code: str) -> None:
    """Record a structured failure on the span."""
    span.set_attribute("stoker.error_code", code)
    span.set_status(Status(StatusCode.ERROR, code))
