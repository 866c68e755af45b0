"""Trace context for calls: the caller's current OpenTelemetry span becomes the parent of the
server's spans (W3C `traceparent` in the call metadata). Without opentelemetry-api installed, or
with no span active, nothing is added."""

try:
    from opentelemetry import propagate
except ImportError:  # optional: the SDK itself needs only grpc
    propagate = None


def current_trace_metadata() -> tuple[tuple[str, str], ...]:
    if propagate is None:
        return ()
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())
