"""Trace spans of engine steps: one `verifier.step` per request per step, under its request span.

Used by the engine thread only, and only when tracing is on (dspark/serving/tracing.py). The
spans of requests that draft are opened before the step, so the drafter link can send each
request's step context with its draft call (carrier()); requests prefilled in the step get
theirs afterwards with the same start time.
"""
from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from dspark.serving import tracing


class StepSpans:
    def __init__(self):
        self.tracer = tracing.tracer()
        self.open: dict[str, trace.Span] = {}
        self.started = 0
        self.step = 0

    def _start(self, job) -> trace.Span:
        return self.tracer.start_span("verifier.step", context=trace.set_span_in_context(job.span),
                                      start_time=self.started, attributes={"dspark.step": self.step})

    def begin(self, jobs) -> None:
        """Before a step: `jobs` are those of the running requests (None entries are skipped)."""
        self.step += 1
        self.started = time.time_ns()
        self.open = {job.request.req_id: self._start(job) for job in jobs if job is not None and job.span is not None}

    def carrier(self, req_id: str) -> dict[str, str]:
        """Trace context of this request's current step, for its SequenceUpdate."""
        span = self.open.get(req_id)
        return tracing.carrier(span) if span is not None else {}

    def end(self, stepped, report, error: str = "") -> None:
        """After the step: `stepped` = (job, new tokens) of every request in it; report = StepReport."""
        outcome = dict(zip(report.req_ids, zip(report.verified, report.accepted))) if report is not None else {}
        for job, tokens in stepped:
            if job.span is None:
                continue
            span = self.open.pop(job.request.req_id, None)
            prefill = span is None  # not running before the step: admitted and prefilled in it
            span = span or self._start(job)
            verified, accepted = outcome.get(job.request.req_id, (0, 0))
            span.set_attributes({
                "dspark.batch_size": report.batch_size, "dspark.batch_tokens": report.batch_tokens,
                "dspark.prefill": prefill, "dspark.draft_tokens": verified,  # l_r: its share of the verify budget
                "dspark.accepted_tokens": accepted, "dspark.new_tokens": len(tokens)})
            span.end()
        for span in self.open.values():  # cancelled during the step, or the step failed
            if error:
                span.set_status(Status(StatusCode.ERROR, error))
            span.end()
        self.open = {}
