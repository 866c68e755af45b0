"""The Drafter gRPC service: one long-lived DraftStream per verifier, one drafter for all of them."""
from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import grpc

from drafter_svc.contexts import Limits, answer
from dspark.proto_gen.v1 import drafter_pb2_grpc
from dspark.serving import metrics, tracing
from dspark.serving.drafter_info import drafter_info
from dspark.wire import WireError

log = logging.getLogger(__name__)


class DrafterService(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, max_batch: int = 64, max_len: int = 1 << 20, max_contexts: int = 128):
        self.max_batch, self.max_len, self.max_contexts = max_batch, max_len, max_contexts
        self.limits: Limits | None = None  # with the vocabulary, once loaded
        self.drafter = None  # set once loaded; until then calls answer UNAVAILABLE
        self.target_model = ""
        self.sts_temperatures: list[float] | None = None  # shipped offline STS fit, if any
        # One worker: the drafter module and its context cache are not thread-safe, and one
        # CPU/GPU stream serves the batched draft calls of all verifiers in turn anyway.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="drafter")
        self._streams = itertools.count(1)

    @property
    def width(self) -> int:
        return len(self.drafter.ctx_layers) * self.drafter.cfg.hidden_size

    async def DrafterInfo(self, request, context):
        if self.drafter is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "drafter is still loading")
        return drafter_info(self.drafter, self.target_model, self.sts_temperatures)

    async def DraftStream(self, request_iterator, context):
        if self.drafter is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "drafter is still loading")
        loop = asyncio.get_running_loop()
        if self.limits is None:
            self.limits = Limits(self.drafter.cfg.vocab_size, self.max_batch, self.max_len, self.max_contexts)
        stream, keys = next(self._streams), OrderedDict()
        try:
            async for request in request_iterator:
                started = time.time_ns()
                try:
                    response = await loop.run_in_executor(self.executor, answer, self.drafter, stream, keys,
                                                          request, self.width, self.limits)
                except WireError as error:
                    # Only this stream ends; its verifier reconnects and resends from scratch.
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
                metrics.DRAFTER_CONTEXTS.set(len(self.drafter.contexts))
                if response is None:  # a context push: nothing to answer
                    metrics.CONTEXT_PUSHES.inc()
                    continue
                if tracing.enabled():
                    record_draft_spans(request, response, stream, started, time.time_ns())
                metrics.DRAFT_REQUESTS.inc()
                yield response
        finally:
            # The verifier is gone (or reconnecting): every context it had here is garbage now.
            await loop.run_in_executor(self.executor, self._release_all, keys)

    def _release_all(self, keys: OrderedDict) -> None:
        for key in list(keys):
            self.drafter.release(key)
        keys.clear()
        return_freed_memory()


def return_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise: RSS would stay at the
    high-water mark of the contexts a closed stream held)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def record_draft_spans(request, response, stream: int, started_ns: int, ended_ns: int) -> None:
    """One `drafter.draft` span per traced request of a batched draft call, under that request's
    verifier step span (why per request: dspark/serving/tracing.py). All share the call's timing."""
    missing = {s.request_id for s in response.sequences if s.context_missing}
    drafted = [u for u in request.sequences if not u.release]
    for update in drafted:
        if not update.trace_context:
            continue
        span = tracing.tracer().start_span(
            "drafter.draft", context=tracing.context_from(update.trace_context), start_time=started_ns,
            attributes={"dspark.job_id": update.request_id, "dspark.draft.call": f"{stream}:{request.step}",
                        "dspark.draft.batch_size": len(drafted), "dspark.draft.context_tokens": len(update.tokens),
                        "dspark.draft.context_missing": update.request_id in missing})
        span.end(end_time=ended_ns)
