"""The verifier's gRPC surface: public Generation (direct use) and internal Verifier (the scheduler's).

Both Generate calls run the same path: check the request, tokenize, hand a job to the engine
thread, then turn its token events into GenerateChunks (text deltas, stop strings, metrics).
A resumed request (ResumeInfo) is prefilled with prompt + the tokens already streamed and
continues after them without sending them again.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from dspark.proto_gen.v1 import generation_pb2 as pb
from dspark.proto_gen.v1 import generation_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from dspark.serving import metrics, tracing
from dspark.serving.requests import (
    RequestError,
    check_max_tokens,
    check_prompt_fits,
    check_request,
    check_token_ids,
    sampling_params,
)
from dspark.serving.textstream import TextStream
from dspark.speculative.engine import EngineRequest
from dspark.speculative.metrics import SpecMetrics
from verifier_svc.runner import Job

log = logging.getLogger(__name__)

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_CANCELLED}


def metrics_proto(m: SpecMetrics | None, prompt_tokens: int, generated: int,
                  prior: pb.SpecMetrics | None) -> pb.SpecMetrics:
    """Per-request counters; `prior` = those of the verifier(s) before a resume."""
    m = m or SpecMetrics()
    steps = m.steps + 1  # the prefill pass produced the first token too
    out = pb.SpecMetrics(prompt_tokens=prompt_tokens, generated_tokens=generated, steps=steps, drafts=m.drafts,
                         draft_tokens=m.draft_tokens, accepted_tokens=m.accepted_tokens,
                         verified_per_position=m.verified_per_pos, accepted_per_position=m.accepted_per_pos)
    if prior is not None:
        out.steps += prior.steps
        out.drafts += prior.drafts
        out.draft_tokens += prior.draft_tokens
        out.accepted_tokens += prior.accepted_tokens
        for name in ("verified_per_position", "accepted_per_position"):
            a, b = list(getattr(out, name)), list(getattr(prior, name))
            n = max(len(a), len(b))
            merged = [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]
            getattr(out, name)[:] = merged
    out.tau = out.generated_tokens / out.steps if out.steps else 0.0
    return out


class VerifierCore:
    """Everything Generate needs, built whole once the model is loaded and the engine runs."""

    def __init__(self, runner, tokenizer, model_name: str, max_len: int, vocab_size: int, drafter_info,
                 default_max_tokens: int, max_tokens_cap: int = 0):
        self.runner, self.tokenizer, self.model_name = runner, tokenizer, model_name
        self.max_len, self.vocab_size = max_len, vocab_size
        self.drafter_info = drafter_info  # DrafterInfoResponse or None (no drafter)
        self.default_max_tokens = default_max_tokens
        self.max_tokens_cap = max_tokens_cap  # 0 = the context length

    def model_info(self) -> pb.ModelInfo:
        d = self.drafter_info
        return pb.ModelInfo(name=self.model_name, drafter=d.kind if d else "", gamma=d.gamma if d else 0,
                            max_context_tokens=self.max_len)

    def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return self.tokenizer.encode(request.text)
        if kind == "token_ids":
            return list(request.token_ids.ids)
        return self.tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in request.messages.messages])

    def admit(self, request: pb.GenerateRequest, resume: verifier_pb2.ResumeInfo | None, span,
              events=None) -> ActiveRequest | pb.GenerateChunk:
        """Check a request and hand it to the engine thread; its events go to `events` (anything
        with put_nowait; a queue of its own by default). Returns the final chunk instead when a
        resumed request has nothing left to generate. Raises RequestError for a bad request."""
        started = time.perf_counter()
        if resume is None and request.HasField("resume"):  # a client's retry sent straight here
            resume = verifier_pb2.ResumeInfo(streamed_token_ids=request.resume.streamed_token_ids,
                                             streamed_text=request.resume.streamed_text)
        streamed = list(resume.streamed_token_ids) if resume is not None else []
        check_request(request, {self.model_name, "default"})
        check_max_tokens(request.max_tokens, self.max_tokens_cap or self.max_len)
        prompt = self._prompt(request)
        if not prompt:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty after tokenization")
        check_token_ids(prompt, self.vocab_size)
        check_token_ids(streamed, self.vocab_size, "resumed token id")
        check_token_ids(list(request.stop_token_ids), self.vocab_size, "stop token id")
        check_prompt_fits(len(prompt), self.max_len)
        params = sampling_params(request, self.default_max_tokens)
        params.max_tokens -= len(streamed)
        job_id = uuid.uuid4().hex  # the engine's and the drafter's key for this job: ours alone
        req_id = request.request_id or job_id  # the client's, echoed in the chunks and traced; never a key
        prior = resume.metrics if resume is not None and resume.HasField("metrics") else None
        if params.max_tokens <= 0 or len(prompt) + len(streamed) >= self.max_len:
            # A resume of a request that had in fact reached its limit: only the final chunk is left.
            return pb.GenerateChunk(request_id=req_id, offset=len(streamed), finish_reason=pb.FINISH_REASON_LENGTH,
                                    metrics=prior or pb.SpecMetrics(prompt_tokens=len(prompt)))
        spec = request.speculation  # the request's draft_len: 0 = no speculation, None = the drafter's block
        draft_len = 0 if spec.disable else (spec.max_draft_tokens or None)
        job = Job(EngineRequest(prompt + streamed, params, job_id, draft_len), asyncio.get_running_loop())
        if events is not None:
            job.events = events
        if span.is_recording():
            job.span = span  # the engine thread hangs this request's step spans under it
            span.set_attributes({"dspark.request_id": req_id, "dspark.job_id": job_id, "dspark.prompt_tokens": len(prompt),
                                 "dspark.resumed_tokens": len(streamed), "dspark.max_tokens": params.max_tokens})
        text = TextStream(self.tokenizer.decode, list(request.stop), streamed,
                          resume.streamed_text if resume is not None else "")
        # Without stop strings the engine thread holds tokens for the chunk interval; with them every
        # step's text is checked here, and the chunks are held here instead.
        interval_s = request.stream_interval_ms / 1e3
        if not text.stop:
            job.hold_s, interval_s = interval_s, 0.0
        active = ActiveRequest(self.runner, job, req_id, text, len(streamed), len(prompt), prior, started, span,
                               interval_s)
        self.runner.submit(job)
        return active

    async def generate(self, request: pb.GenerateRequest, resume: verifier_pb2.ResumeInfo | None, context):
        """One request, one stream of chunks (the public Generate and Verifier.Generate)."""
        with tracing.server_span("verifier.generate", context,
                                 {"dspark.request_id": request.request_id, "dspark.resumed": resume is not None}) as span:
            try:
                active = self.admit(request, resume, span)
            except RequestError as error:
                await context.abort(error.code, error.message)
            if isinstance(active, pb.GenerateChunk):
                yield active
                return
            try:
                while not active.done:
                    chunk = active.chunk(await active.job.events.get())
                    if chunk is not None:
                        yield chunk
            finally:
                active.abandon()

    async def generate_many(self, commands, context):
        """Many requests over one stream (Verifier.GenerateMany): one ChunkBatch per engine step
        with the chunk of every request that moved, refusals keyed like chunks. The stream ends
        once the caller has closed its side and every request it started has finished."""
        inbox = StreamInbox()
        active: dict[int, ActiveRequest] = {}

        def end_abandoned(request: ActiveRequest) -> None:
            request.abandon()
            request.span.set_attribute("dspark.cancelled", True)
            request.span.end()

        def refuse(key: int, code: grpc.StatusCode, message: str) -> None:
            inbox.put(key, verifier_pb2.KeyedChunk(key=key, status_code=code.value[0], status_message=message))

        async def read() -> None:
            try:
                async for command in commands:
                    key, kind = command.key, command.WhichOneof("command")
                    if kind == "cancel":
                        if key in active:
                            end_abandoned(active.pop(key))
                        continue
                    if kind != "start":
                        refuse(key, grpc.StatusCode.INVALID_ARGUMENT, "a command needs start or cancel")
                    elif key in active:
                        refuse(key, grpc.StatusCode.INVALID_ARGUMENT, f"key {key} is in use on this stream")
                    else:
                        start = command.start
                        resume = start.resume if start.HasField("resume") else None
                        span = tracing.child_span("verifier.generate", command.trace_context,
                                                  {"dspark.request_id": start.request.request_id,
                                                   "dspark.resumed": resume is not None})
                        try:
                            admitted = self.admit(start.request, resume, span, events=inbox.sink(key))
                        except RequestError as error:
                            span.end()
                            refuse(key, error.code, error.message)
                            continue
                        except Exception as error:  # a bug on one request: the stream's others go on
                            log.exception("admitting request %r failed", start.request.request_id)
                            span.end()
                            refuse(key, grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}")
                            continue
                        if isinstance(admitted, pb.GenerateChunk):
                            span.end()
                            inbox.put(key, verifier_pb2.KeyedChunk(key=key, chunk=admitted))
                        else:
                            active[key] = admitted
            finally:
                inbox.wake()

        reader = asyncio.create_task(read())
        try:
            while True:
                items = await inbox.take()
                batch = verifier_pb2.ChunkBatch()
                for key, item in items:
                    if isinstance(item, verifier_pb2.KeyedChunk):
                        batch.chunks.append(item)
                    elif key in active:  # else cancelled after the engine sent this
                        request = active[key]
                        chunk = request.chunk(item)
                        if chunk is not None:
                            batch.chunks.add(key=key, chunk=chunk)
                        if request.done:
                            del active[key]
                            request.span.end()
                if batch.chunks:
                    yield batch
                if reader.done() and not active and not inbox.items:
                    reader.result()  # the caller's stream broke: raise what broke it
                    return
        finally:
            reader.cancel()
            for request in active.values():
                end_abandoned(request)


class StreamInbox:
    """Where a GenerateMany stream's engine events land, as (key, event) in delivery order. The
    runner hands an event loop one step's events in one callback, so a step wakes the stream once."""

    def __init__(self):
        self.items: list[tuple[int, object]] = []
        self._ready = asyncio.Event()

    def put(self, key: int, item) -> None:
        self.items.append((key, item))
        self._ready.set()

    def sink(self, key: int) -> _KeyedSink:
        return _KeyedSink(self, key)

    def wake(self) -> None:
        self._ready.set()

    async def take(self) -> list[tuple[int, object]]:
        await self._ready.wait()
        self._ready.clear()
        items, self.items = self.items, []
        return items


class _KeyedSink:
    """A Job's event queue on a shared stream: puts land in the inbox under the request's key."""

    def __init__(self, inbox: StreamInbox, key: int):
        self.inbox, self.key = inbox, key

    def put_nowait(self, event) -> None:
        self.inbox.put(self.key, event)


class ActiveRequest:
    """An admitted request: its engine job, and the text and offset its chunks carry on."""

    def __init__(self, runner, job: Job, req_id: str, text: TextStream, offset: int, prompt_len: int,
                 prior: pb.SpecMetrics | None, started: float, span, interval_s: float = 0.0):
        self.runner, self.job, self.req_id, self.text = runner, job, req_id, text
        self.offset, self.prompt_len, self.prior, self.started, self.span = offset, prompt_len, prior, started, span
        self.interval_s = interval_s  # how long chunks are held here (with stop strings; else Job.hold_s)
        self.held: pb.GenerateChunk | None = None  # decoded tokens not sent yet
        self.last_sent: float | None = None
        self.done = False

    def chunk(self, event) -> pb.GenerateChunk | None:
        """The chunk to send after one engine event, or None while its tokens are held (at most
        one chunk per interval; the first and the last are never held). Sets `done` on the last.
        Every event's text is checked at once, so a stop string ends the request when it is hit
        (without stop strings the engine thread holds the tokens instead: Job.release)."""
        final = event.finish is not None
        tokens = list(event.tokens)
        now = time.monotonic()
        due = final or self.last_sent is None or now - self.last_sent >= self.interval_s
        delta, stop_hit = self.text.push(tokens, final=final)
        if stop_hit:  # a stop string inside an accepted burst: the tokens after it are not output
            tokens = tokens[:len(tokens) - self.text.overshoot]
        if self.held is None:
            self.held = pb.GenerateChunk(request_id=self.req_id, offset=self.offset)
        chunk = self.held
        chunk.token_ids.extend(tokens)
        chunk.text += delta
        self.offset += len(tokens)
        metrics.GENERATED_TOKENS.inc(len(tokens))
        if stop_hit and not final:
            self.runner.cancel(self.job)
        if final or stop_hit:
            self.done = True
            chunk.finish_reason = pb.FINISH_REASON_STOP if stop_hit else FINISH[event.finish]
            if event.error:
                chunk.finish_reason, chunk.error = pb.FINISH_REASON_ERROR, event.error
            chunk.metrics.CopyFrom(metrics_proto(event.metrics or self.job.seq.spec.metrics, self.prompt_len,
                                                 self.offset, self.prior))
            metrics.REQUEST_LATENCY.observe(time.perf_counter() - self.started)
            self.span.set_attributes({"dspark.generated_tokens": self.offset,
                                      "dspark.finish_reason": pb.FinishReason.Name(chunk.finish_reason),
                                      "dspark.draft_tokens": chunk.metrics.draft_tokens,
                                      "dspark.accepted_tokens": chunk.metrics.accepted_tokens})
        if not (due or self.done):
            return None
        self.held, self.last_sent = None, now
        return chunk

    def abandon(self) -> None:
        """The caller went away (or its stream ended): free the slot now."""
        if not self.done:
            self.done = True
            self.runner.cancel(self.job)


class CoreSlot:
    """Where the services find the VerifierCore: empty while the model loads (calls then get
    UNAVAILABLE), then the whole core, set once."""

    def __init__(self):
        self.core: VerifierCore | None = None

    async def get(self, context) -> VerifierCore:
        if self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "model is still loading")
        return self.core


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, slot: CoreSlot):
        self.slot = slot

    async def Generate(self, request, context):
        core = await self.slot.get(context)
        async for chunk in core.generate(request, None, context):
            yield chunk

    async def ListModels(self, request, context):
        core = await self.slot.get(context)
        return pb.ListModelsResponse(models=[core.model_info()])


class VerifierService(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, slot: CoreSlot, load_fn, apply_budget):
        self.slot, self.load_fn, self.apply_budget = slot, load_fn, apply_budget

    async def Generate(self, request, context):
        core = await self.slot.get(context)
        resume = request.resume if request.HasField("resume") else None
        async for chunk in core.generate(request.request, resume, context):
            yield chunk

    async def GenerateMany(self, request_iterator, context):
        core = await self.slot.get(context)
        async for batch in core.generate_many(request_iterator, context):
            yield batch

    async def SetVerifyBudget(self, request, context):
        self.apply_budget(request)
        return verifier_pb2.SetVerifyBudgetResponse()

    async def GetLoad(self, request, context):
        await self.slot.get(context)
        return self.load_fn()
