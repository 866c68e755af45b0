"""Prometheus metrics of the services, named as docs/deploy.md ("What to watch") lists them."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

# Verifier.
GENERATED_TOKENS = Counter("dspark_generated_tokens", "Tokens generated and streamed")
NUM_DRAFTS = Counter("vllm:spec_decode_num_drafts", "Verified draft blocks (steps of a request with drafts)")
NUM_DRAFT_TOKENS = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified")
NUM_ACCEPTED = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted")
ACCEPTED_PER_POS = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                           "Accepted draft tokens by block position (0-based, as vLLM; dspark_calibration_ece is 1-based)",
                           ["position"])
STEP_LATENCY = Histogram("dspark_step_latency_seconds", "Verifier step latency", ["batch_tokens_bucket"],
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
REQUEST_LATENCY = Histogram("dspark_request_latency_seconds", "Request latency, first byte in to last chunk out",
                            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250))
VERIFY_BUDGET = Gauge("dspark_verify_budget", "Verify budget in force: draft tokens the last step let the whole "
                      "batch verify")
VERIFY_BUDGET_FROM_SCHEDULER = Gauge("dspark_verify_budget_from_scheduler",
                                     "1 while the scheduler's budget is in force, 0 on the default (--draft-len per "
                                     "request)")
SCHEDULED_DRAFT_TOKENS = Counter("dspark_scheduled_draft_tokens", "Draft tokens verified while the scheduler's budget "
                                 "was in force")
PREFIX_REUSED_TOKENS = Counter("dspark_prefix_reused_tokens", "Prompt tokens new requests took from a freed KV "
                               "slot instead of computing them (prefix reuse)")
DRAFT_SKIPPED_STEPS = Counter("dspark_draft_skipped_steps", "Decode steps that skipped the drafter (budget 0: plain "
                              "decoding, drafting would cost more than it saves)")
VERIFIED_PER_REQUEST = Histogram("dspark_verified_tokens_per_request", "Draft tokens verified per request per step",
                                 buckets=(0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16))
SPS_POINTS = Gauge("dspark_sps_table_points", "Batch-token counts with a measured step time in the SPS table")
DRAFTER_LINK_BYTES = Counter("dspark_drafter_link_bytes", "Bytes on the verifier-drafter link", ["direction"])
DRAFTER_LINK_BYTES_PER_STEP = Histogram("dspark_drafter_link_bytes_per_step", "Bytes per step on the drafter link",
                                        buckets=(1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8))
DRAFTS_AHEAD_SENT = Counter("dspark_drafts_ahead_sent", "Request blocks drafted ahead, while the target verified")
DRAFTS_AHEAD_USED = Counter("dspark_drafts_ahead_used", "Request blocks drafted ahead whose guess held (no wait for "
                            "a draft)")
DRAFTER_UNAVAILABLE = Counter("dspark_drafter_unavailable", "Steps run as plain decoding: drafter failed")
# Drafter.
DRAFT_REQUESTS = Counter("dspark_drafter_requests", "DraftRequests answered")
CONTEXT_PUSHES = Counter("dspark_drafter_context_pushes", "Context-only DraftRequests applied (no answer)")
DRAFTER_CONTEXTS = Gauge("dspark_drafter_contexts", "Request contexts held by the drafter")
# Scheduler.
QUEUE_DEPTH = Gauge("dspark_queue_depth", "Requests waiting for a verifier with room")
RESUMED = Counter("dspark_resumed_requests", "Requests resumed on another verifier after losing theirs")
SCHEDULED_VERIFY_BUDGET = Gauge("dspark_scheduled_verify_budget",
                                "Verify budget last computed for a verifier (two-step rule)", ["verifier_id"])
LIVE_CONFIDENCE_OFFSET = Gauge("dspark_live_confidence_offset",
                               "Logit offset the budget adds to a verifier's calibrated confidences, "
                               "fitted on its recent verification outcomes", ["verifier_id"])
CALIBRATION_ECE = Gauge("dspark_calibration_ece", "Online calibration: ECE of the calibrated per-token confidence "
                        "at each block position (1-based), from the accumulated statistics", ["position"])
CALIBRATION_VERSION = Gauge("dspark_calibration_version", "Version of the newest STS temperatures",
                            ["drafter_version"])
CALIBRATION_REPORTS = Counter("dspark_calibration_reports", "Step reports folded into the online calibration")


# Verifier and drafter.
DEVICE = Gauge("dspark_device_info", "1 for the device this service's model runs on", ["service", "device"])


def report_device(service: str, device: str) -> None:
    DEVICE.labels(service, device).set(1)


def batch_tokens_bucket(tokens: int) -> str:
    for low, high in ((1, 64), (65, 256), (257, 1024), (1025, 4096)):
        if tokens <= high:
            return f"{low}-{high}"
    return "4097+"


def start_metrics_server(port: int) -> None:
    start_http_server(port)
