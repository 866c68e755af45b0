"""OTLP export of the services' Prometheus metrics (when OTEL_EXPORTER_OTLP_ENDPOINT is set).

prometheus_client stays the one place metrics are recorded: its names on /metrics are the
contract (docs/deploy.md). For OTLP, an OpenTelemetry MeterProvider with observable instruments
reads the prometheus_client registry at each export, so the hot paths record once:
  counter   -> ObservableCounter (cumulative), same labels as attributes
  gauge     -> ObservableGauge
  histogram -> its Prometheus series as cumulative counters: <name>_bucket (attribute `le`),
               <name>_sum, <name>_count (OpenTelemetry has no observable histogram)
Only our families (dspark_*, vllm:*) are sent. OpenTelemetry instrument names allow no ':', so
`vllm:spec_decode_...` goes out as `vllm_spec_decode_...` (what the OTel Prometheus exporter
would show too).
"""
from __future__ import annotations

import os

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import REGISTRY

PREFIXES = ("dspark_", "vllm:")


def _otel_name(name: str) -> str:
    return name.replace(":", "_")


def _observe(registry, family_name: str, sample_name: str):
    """Callback: the current values of one sample series of one family."""
    def callback(_options: CallbackOptions):
        for family in registry.collect():
            if family.name == family_name:
                return [Observation(s.value, dict(s.labels)) for s in family.samples if s.name == sample_name]
        return []
    return callback


def bridge(provider: MeterProvider, registry=REGISTRY) -> int:
    """Observable instruments on `provider` for every dspark_/vllm: family in `registry`; returns how many."""
    meter = provider.get_meter("dspark.prometheus_bridge")
    count = 0
    for family in registry.collect():
        if not family.name.startswith(PREFIXES):
            continue
        name, doc = family.name, family.documentation
        if family.type == "counter":
            meter.create_observable_counter(_otel_name(name), [_observe(registry, name, name + "_total")],
                                            description=doc)
        elif family.type == "gauge":
            meter.create_observable_gauge(_otel_name(name), [_observe(registry, name, name)], description=doc)
        elif family.type == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                meter.create_observable_counter(_otel_name(name + suffix), [_observe(registry, name, name + suffix)],
                                                description=doc)
        else:
            continue
        count += 1
    return count


def make_provider(service_name: str, exporter: MetricExporter, interval_ms: float | None = None,
                  registry=REGISTRY) -> MeterProvider:
    """A MeterProvider that exports the bridged registry through `exporter` every interval
    (default: OTEL_METRIC_EXPORT_INTERVAL, else 60 s)."""
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval_ms)
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": service_name}))
    bridge(provider, registry)
    return provider


def setup(service_name: str) -> MeterProvider | None:
    """OTLP/gRPC metrics export when OTEL_EXPORTER_OTLP_ENDPOINT is set; None otherwise.

    Call after every metric is defined (dspark.serving.metrics is imported by then)."""
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return None
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    return make_provider(service_name, OTLPMetricExporter())  # MeterProvider flushes at exit
