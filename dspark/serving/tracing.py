"""OpenTelemetry traces of the services: setup, and W3C trace context across gRPC calls.

The spans of one request form one trace:

    scheduler.generate   (scheduler, SERVER)  the whole request; a resume on another verifier is an event
      verifier.generate  (verifier, SERVER)   one per verifier the request ran on
        verifier.step    (verifier)           one per engine step the request took part in
          drafter.draft  (drafter)            the draft call of that step, for this request

Context crosses processes as `traceparent` in the gRPC metadata of each Generate call (client ->
scheduler -> verifier). The verifier's DraftStream is one long-lived call whose metadata is sent
once, so per-step context travels in SequenceUpdate.trace_context instead. A draft call serves
the whole batch; the drafter still writes one span per request in it, parented to that request's
step span (same start and end for all of them, `dspark.draft.batch_size` says how many shared
the call): each request's trace then shows its draft time inside its steps without following
links, which most trace viewers show poorly.

Export (set up once per process by setup()):
  OTEL_EXPORTER_OTLP_ENDPOINT set  -> OTLP over gRPC, batched (the standard OTEL_* variables apply)
  DSPARK_TRACE_FILE=path           -> every finished span as one JSON line, written when it ends
                                      (tests; "{service}" in the path becomes the service name)
  neither                          -> tracing off: no spans are created at all
Spans are never made "current": the handlers are async generators, which resume in other
contexts, so parents are always passed explicitly.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import threading

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode

_enabled = False


def enabled() -> bool:
    return _enabled


def service_name(name: str) -> str:
    """OTEL_SERVICE_NAME if set (the chart sets it), else dspark-<name>."""
    return os.environ.get("OTEL_SERVICE_NAME") or f"dspark-{name}"


class JsonLinesExporter(SpanExporter):
    """Finished spans as JSON lines (ReadableSpan.to_json), appended to one file per process."""

    def __init__(self, path: str):
        self._file = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()  # spans end on the event loop and on the engine thread

    def export(self, spans) -> SpanExportResult:
        with self._lock:
            for span in spans:
                self._file.write(span.to_json(indent=None) + "\n")
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


def make_provider(name: str, exporters: list[tuple[SpanExporter, bool]]) -> TracerProvider:
    """A provider for service `name`; exporters: (exporter, batched)."""
    provider = TracerProvider(resource=Resource.create({"service.name": service_name(name)}))
    for exporter, batched in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter) if batched else SimpleSpanProcessor(exporter))
    return provider


def setup(name: str) -> bool:
    """Install the global tracer provider from the environment (see the module doc); True if on."""
    global _enabled
    exporters = []
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporters.append((OTLPSpanExporter(), True))
    path = os.environ.get("DSPARK_TRACE_FILE")
    if path:
        exporters.append((JsonLinesExporter(path.replace("{service}", name)), False))
    if exporters:
        trace.set_tracer_provider(make_provider(name, exporters))  # flushed and shut down at exit
        _enabled = True
    return _enabled


def tracer() -> trace.Tracer:
    return trace.get_tracer("dspark")


# ---- trace context in gRPC metadata and in proto maps ---------------------------------------
def carrier(span: trace.Span) -> dict[str, str]:
    """{"traceparent": ...} for `span` (empty for a non-recording one)."""
    out: dict[str, str] = {}
    if span.get_span_context().is_valid:
        propagate.inject(out, context=trace.set_span_in_context(span))
    return out


def metadata(span: trace.Span) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata that makes the callee's spans children of `span`."""
    return tuple(carrier(span).items())


def context_from(pairs) -> Context:
    """Parent context from gRPC metadata (invocation_metadata()) or a proto map."""
    items = pairs.items() if hasattr(pairs, "items") else pairs
    return propagate.extract({k: v for k, v in items if isinstance(v, str)})


def child_span(name: str, carrier_map, attributes: dict | None = None) -> trace.Span:
    """A started SERVER span, child of the span a proto map carries (the caller ends it): for a
    request inside a stream that carries many. trace.INVALID_SPAN when tracing is off."""
    if not _enabled:
        return trace.INVALID_SPAN
    return tracer().start_span(name, context=context_from(carrier_map), kind=SpanKind.SERVER, attributes=attributes)


@contextlib.contextmanager
def server_span(name: str, grpc_context, attributes: dict | None = None):
    """A SERVER span for one call, child of the caller's span when its metadata carries one.

    Yields trace.INVALID_SPAN (whose methods do nothing) when tracing is off."""
    if not _enabled:
        yield trace.INVALID_SPAN
        return
    parent = context_from(grpc_context.invocation_metadata() or ())
    span = tracer().start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
    try:
        yield span
    except (GeneratorExit, asyncio.CancelledError):  # the caller stopped reading or went away
        span.set_attribute("dspark.cancelled", True)
        raise
    except BaseException as error:
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        raise
    finally:
        span.end()
