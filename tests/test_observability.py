"""Traces and metrics of the three real services (tiny target, random drafter) on localhost.

Every service writes its finished spans as JSON lines (DSPARK_TRACE_FILE) and also exports
traces and metrics over OTLP/gRPC to a small collector this test runs; one request sent under a
client-side root span must give one trace across client, scheduler, verifier and drafter.
"""
from __future__ import annotations

import json
import threading
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client.parser import text_string_to_metric_families
from service_helpers import (free_port, start_drafter, start_scheduler, start_verifier, wait_registered, wait_serving,
                             wait_until, write_tiny_target)

pytestmark = pytest.mark.slow
PROMPT = [5, 9, 30, 41]
MAX_TOKENS = 24


class Collector(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    """An OTLP/gRPC receiver keeping what it is sent."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []  # (service.name, Span proto)
        self.metrics: list[tuple[str, object]] = []  # (service.name, Metric proto)
        self.lock = threading.Lock()

    @staticmethod
    def _service(resource) -> str:
        return next((a.value.string_value for a in resource.attributes if a.key == "service.name"), "")

    def Export(self, request, context):
        with self.lock:
            if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
                for rs in request.resource_spans:
                    self.spans += [(self._service(rs.resource), s) for ss in rs.scope_spans for s in ss.spans]
                return trace_service_pb2.ExportTraceServiceResponse()
            for rm in request.resource_metrics:
                self.metrics += [(self._service(rm.resource), m) for sm in rm.scope_metrics for m in sm.metrics]
            return metrics_service_pb2.ExportMetricsServiceResponse()


@pytest.fixture(scope="module")
def collector():
    received = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(received, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(received, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    received.endpoint = f"http://127.0.0.1:{port}"
    yield received
    server.stop(0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, collector):
    tmp = tmp_path_factory.mktemp("obs")
    target = str(write_tiny_target(tmp / "tiny"))
    env = pytest.MonkeyPatch()  # the service processes copy this process's environment
    env.setenv("DSPARK_TRACE_FILE", str(tmp / "spans-{service}.jsonl"))
    env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)
    env.setenv("OTEL_METRIC_EXPORT_INTERVAL", "500")
    env.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    ports = {name: free_port() for name in ("drafter", "verifier", "scheduler")}
    services = []
    try:
        drafter, d_addr = start_drafter(target, tmp, metrics_port=ports["drafter"])
        # Any promised gain drafts (the bare two-step rule): this test is about the metrics of drafts.
        scheduler, s_addr = start_scheduler(tmp, [], metrics_port=ports["scheduler"], min_draft_gain=1.0)
        services += [drafter, scheduler]
        # A draft every step, each verified whole (explore=1): on the tiny target drafting never pays,
        # and once the scheduler says K = 0 a draft would be probed but not verified (a run on a busy
        # host once saw drafts = 0 that way). No prompt lookup: its blocks never reach the drafter,
        # and every drafted step here must have a draft span.
        # A 10 s drafter deadline: on a loaded CI host the first drafts can pass the helpers' 1 s, and
        # a generation without drafts has no draft metrics to check.
        verifier, v_addr = start_verifier(target, tmp, d_addr, s_addr, metrics_port=ports["verifier"],
                                          draft_probe_every=1, explore=1.0, lookup="off", drafter_timeout_s=10)
        services.append(verifier)
        for service, address in ((drafter, d_addr), (scheduler, s_addr), (verifier, v_addr)):
            wait_serving(address, service, timeout=120)
        wait_registered(s_addr, 1)
        yield dict(scheduler=s_addr, tmp=tmp, metrics=ports)
    finally:
        env.undo()
        for service in services:
            service.kill()


def read_spans(tmp) -> list[dict]:
    spans = []
    for path in tmp.glob("spans-*.jsonl"):
        spans += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return spans


def generate(address: str, **kw):
    from dspark_client import Client

    with Client(address, timeout=120) as client:
        return client.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS, **kw)


def test_one_trace_across_client_scheduler_verifier_drafter(cluster, collector):
    # A client-side root span (local provider, nothing global); the SDK sends its context along.
    root = TracerProvider().get_tracer("test").start_span("client.request")
    with trace.use_span(root, end_on_exit=True):
        result = generate(cluster["scheduler"])
    trace_id = f"0x{root.get_span_context().trace_id:032x}"
    root_id = f"0x{root.get_span_context().span_id:016x}"
    assert len(result.token_ids) == MAX_TOKENS and result.metrics.draft_tokens > 0

    def ours():
        spans = [s for s in read_spans(cluster["tmp"]) if s["context"]["trace_id"] == trace_id]
        names = {s["name"] for s in spans}
        done = {"scheduler.generate", "verifier.generate", "drafter.draft"} <= names
        return spans if done and sum(s["name"] == "verifier.step" for s in spans) == result.metrics.steps else None

    spans = wait_until(ours, 15, what="spans of the request in the span files")
    by_name = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    services = {s["resource"]["attributes"]["service.name"] for s in spans}
    assert services == {"dspark-scheduler", "dspark-verifier", "dspark-drafter"}

    (sched,) = by_name["scheduler.generate"]
    (ver,) = by_name["verifier.generate"]
    assert sched["parent_id"] == root_id and sched["kind"] == "SpanKind.SERVER"
    assert sched["resource"]["attributes"]["service.name"] == "dspark-scheduler"
    assert ver["parent_id"] == sched["context"]["span_id"]
    assert ver["resource"]["attributes"]["service.name"] == "dspark-verifier"
    assert sched["attributes"]["dspark.request_id"] == ver["attributes"]["dspark.request_id"] == result.request_id
    assert ver["attributes"]["dspark.generated_tokens"] == MAX_TOKENS
    assert ver["attributes"]["dspark.finish_reason"] == "FINISH_REASON_LENGTH"

    # One step span per engine step of the request, under its request span, adding up to its metrics.
    steps = by_name["verifier.step"]
    assert all(s["parent_id"] == ver["context"]["span_id"] for s in steps)
    assert [s["attributes"]["dspark.prefill"] for s in steps].count(True) == 1
    assert sum(s["attributes"]["dspark.new_tokens"] for s in steps) == MAX_TOKENS
    assert sum(s["attributes"]["dspark.draft_tokens"] for s in steps) == result.metrics.draft_tokens
    assert sum(s["attributes"]["dspark.accepted_tokens"] for s in steps) == result.metrics.accepted_tokens
    assert all(s["attributes"]["dspark.batch_size"] >= 1 and s["attributes"]["dspark.batch_tokens"] >= 1
               for s in steps)

    # Every step that verified drafts had its draft call traced in the drafter, as the step's child.
    step_by_id = {s["context"]["span_id"]: s for s in steps}
    drafts = by_name["drafter.draft"]
    assert all(d["parent_id"] in step_by_id for d in drafts)
    drafted_steps = {d["parent_id"] for d in drafts}
    assert {i for i, s in step_by_id.items() if s["attributes"]["dspark.draft_tokens"] > 0} <= drafted_steps
    assert len(drafted_steps) == len(drafts)  # one draft span per step for this request
    for d in drafts:
        step = step_by_id[d["parent_id"]]
        assert step["start_time"] <= d["start_time"] <= d["end_time"] <= step["end_time"]
        # The drafter knows the verifier's own id of the job (never the client's request_id).
        assert d["attributes"]["dspark.job_id"] == ver["attributes"]["dspark.job_id"]
        assert d["attributes"]["dspark.draft.batch_size"] == 1

    # The same trace went out over OTLP from all three services.
    raw_trace_id = root.get_span_context().trace_id.to_bytes(16, "big")

    def otlp_services():
        with collector.lock:
            names = {svc for svc, s in collector.spans if s.trace_id == raw_trace_id}
        return names == {"dspark-scheduler", "dspark-verifier", "dspark-drafter"}

    wait_until(otlp_services, 15, what="OTLP spans from all three services")


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def test_prometheus_counters_move_with_a_generation(cluster):
    ports = cluster["metrics"]
    before = scrape(ports["verifier"])
    drafter_before = scrape(ports["drafter"])
    result = generate(cluster["scheduler"])
    m = result.metrics
    expected = {
        "dspark_generated_tokens_total": MAX_TOKENS,
        "vllm:spec_decode_num_drafts_total": m.drafts,
        "vllm:spec_decode_num_draft_tokens_total": m.draft_tokens,
        "vllm:spec_decode_num_accepted_tokens_total": m.accepted_tokens,
        "vllm:spec_decode_num_accepted_tokens_per_pos_total": m.accepted_tokens,  # summed over positions
        "dspark_request_latency_seconds_count": 1,
        "dspark_step_latency_seconds_count": m.steps,
    }
    assert m.drafts > 0 and m.draft_tokens > 0

    def moved():
        after = scrape(ports["verifier"])
        deltas = {name: total(after, name) - total(before, name) for name in expected}
        return deltas if deltas == expected else None

    try:
        wait_until(moved, 5, what="verifier counters")
    except TimeoutError:
        after = scrape(ports["verifier"])
        pytest.fail(f"deltas {[(n, total(after, n) - total(before, n)) for n in expected]} != {expected}")
    after = scrape(ports["verifier"])
    assert ("dspark_verify_budget", ()) in after
    assert after[("dspark_device_info", (("device", "cpu"), ("service", "verifier")))] == 1  # where it runs
    drafter_after = scrape(ports["drafter"])
    assert drafter_after[("dspark_device_info", (("device", "cpu"), ("service", "drafter")))] == 1
    assert total(drafter_after, "dspark_drafter_requests_total") > total(drafter_before, "dspark_drafter_requests_total")
    assert ("dspark_queue_depth", ()) in scrape(ports["scheduler"])


def test_metrics_exported_over_otlp(cluster, collector):
    generate(cluster["scheduler"])

    def exported():
        with collector.lock:
            got = {(svc, m.name): m for svc, m in collector.metrics}
        draft_tokens = got.get(("dspark-verifier", "vllm_spec_decode_num_draft_tokens"))
        generated = got.get(("dspark-verifier", "dspark_generated_tokens"))
        # an export can be taken between the last token streamed and its count: wait for the whole request
        whole = generated is not None and generated.sum.data_points[0].as_double >= MAX_TOKENS
        # each service exports on its own clock: wait for the drafter's and the scheduler's too
        others = ("dspark-drafter", "dspark_drafter_requests") in got and ("dspark-scheduler", "dspark_queue_depth") in got
        return got if whole and others and draft_tokens and draft_tokens.sum.data_points[0].as_double > 0 else None

    got = wait_until(exported, 30, what="metrics of all three services over OTLP (every generated token counted)")
    assert got[("dspark-verifier", "dspark_generated_tokens")].sum.is_monotonic
    assert ("dspark-verifier", "dspark_step_latency_seconds_bucket") in got
    assert ("dspark-scheduler", "dspark_queue_depth") in got
    assert ("dspark-drafter", "dspark_drafter_requests") in got
