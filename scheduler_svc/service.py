"""Public Generation (proxy with resume) and the verifiers' Scheduler API.

A request goes to the least loaded live verifier with room, waiting in the pending queue when
all are full. Its chunks are relayed as they come; if the verifier is lost mid-stream the
request continues on another one with ResumeInfo (the tokens and text already streamed), so the
client sees no token twice and none missing.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc
import numpy as np
import torch

from dspark.proto_gen.v1 import generation_pb2 as pb
from dspark.proto_gen.v1 import generation_pb2_grpc, load_pb2, scheduler_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from dspark.serving import metrics, tracing
from dspark.serving.config import aio_channel
from dspark.serving.guard import caller_identity
from dspark.serving.requests import RequestError, check_request
from dspark.wire import WireError, tensor_from_proto
from scheduler_svc.budget_planner import BudgetPlanner
from scheduler_svc.online_calibration import OnlineCalibrator
from scheduler_svc.registry import Registry
from scheduler_svc.verifier_binding import caller_refusal, peer_host, registration_refusal
from scheduler_svc.verifier_stream import StreamError, VerifierStream

log = logging.getLogger(__name__)

# Codes that mean "the verifier went away", not "the request is bad": resume elsewhere.
LOST = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED}


class VerifierLost(Exception):
    pass


class Router:
    """Channels to verifiers and the wait for one with room."""

    def __init__(self, registry: Registry, max_message_mb: float, queue_timeout_s: float):
        self.registry, self.max_message_mb, self.queue_timeout_s = registry, max_message_mb, queue_timeout_s
        self._stubs: dict[str, verifier_pb2_grpc.VerifierStub] = {}
        self._streams: dict[str, VerifierStream] = {}
        self._channels: list[grpc.aio.Channel] = []
        self.waiting = 0

    def stub(self, address: str) -> verifier_pb2_grpc.VerifierStub:
        if address not in self._stubs:
            channel = aio_channel(address, self.max_message_mb)
            self._channels.append(channel)
            self._stubs[address] = verifier_pb2_grpc.VerifierStub(channel)
        return self._stubs[address]

    def stream(self, address: str) -> VerifierStream:
        """The open GenerateMany stream to a verifier; a new one once the last broke."""
        stream = self._streams.get(address)
        if stream is None or stream.broken is not None:
            stream = self._streams[address] = VerifierStream(self.stub(address))
        return stream

    async def acquire(self, request_id: str) -> str | None:
        """A verifier address, counted in flight; None when none had room within the queue timeout."""
        deadline = time.monotonic() + self.queue_timeout_s
        queued = None  # the store call that put this request on the pending list
        try:
            while True:
                address = self.registry.choose()
                if address is not None:
                    self.registry.inflight[address] += 1
                    return address
                if queued is None:
                    self.waiting += 1
                    metrics.QUEUE_DEPTH.set(self.waiting)
                    queued = self.registry.background(self.registry.store.push_pending(request_id))
                if time.monotonic() >= deadline:
                    return None
                await asyncio.sleep(0.05)
        finally:
            if queued is not None:
                self.waiting -= 1
                metrics.QUEUE_DEPTH.set(self.waiting)
                self.registry.background(self.registry.store.remove_pending(request_id), after=queued)

    def release(self, address: str) -> None:
        self.registry.finish(address)

    async def close(self) -> None:
        for stream in self._streams.values():
            stream.close()
        for channel in self._channels:
            await channel.close()


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router, max_resumes: int = 8):
        self.router, self.registry, self.max_resumes = router, router.registry, max_resumes

    async def Generate(self, request, context):
        with tracing.server_span("scheduler.generate", context, {"dspark.request_id": request.request_id}) as span:
            async for chunk in self._generate(request, context, span):
                yield chunk

    async def _generate(self, request, context, span):
        models = self.registry.models()
        try:
            check_request(request, (models | {"default"}) if models else None)
        except RequestError as error:
            await context.abort(error.code, error.message)
        request = pb.GenerateRequest.FromString(request.SerializeToString())
        job_id = uuid.uuid4().hex  # ours; the client's request_id is for tracing only and may repeat
        request.request_id = request.request_id or job_id
        span.set_attributes({"dspark.request_id": request.request_id, "dspark.job_id": job_id})
        # A client's retry on this replica of a stream that broke elsewhere: go on after its tokens.
        streamed: list[int] = list(request.resume.streamed_token_ids)
        text: list[str] = [request.resume.streamed_text] if request.HasField("resume") else []
        request.ClearField("resume")
        lost = 0
        while True:
            address = await self.router.acquire(job_id)
            if address is None:
                if streamed:  # the client has part of the answer: end it cleanly, do not break the stream
                    yield pb.GenerateChunk(request_id=request.request_id, offset=len(streamed),
                                           finish_reason=pb.FINISH_REASON_ERROR,
                                           error="no verifier available to resume on")
                    return
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no verifier available (all busy or none live)")
            routed = verifier_pb2.RoutedGenerateRequest(request=request)
            if streamed or lost:
                routed.resume.streamed_token_ids.extend(streamed)
                routed.resume.streamed_text = "".join(text)
            span.set_attribute("dspark.verifier", address)
            stream = self.router.stream(address)
            key = stream.start(routed, tracing.carrier(span))
            try:
                async for chunk in self._relay(stream.chunks(key), streamed, text,
                                               has_peer=lambda: len(self.registry.live()) > 1):
                    yield chunk
                    if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        return
                raise VerifierLost("stream ended without a final chunk")
            except StreamError as error:
                if error.code() not in LOST:  # a verdict on the request itself: pass it on
                    if streamed:
                        yield pb.GenerateChunk(request_id=request.request_id, offset=len(streamed),
                                               finish_reason=pb.FINISH_REASON_ERROR, error=error.details() or "")
                        return
                    await context.abort(error.code(), error.details() or "")
                why = f"{error.code().name}: {error.details()}"
            except VerifierLost as error:
                why = str(error)
            finally:
                stream.finish(key)
                self.router.release(address)
            lost += 1
            self.registry.mark_dead(address)
            metrics.RESUMED.inc()
            span.add_event("resume", {"dspark.lost_verifier": address, "dspark.streamed_tokens": len(streamed),
                                      "dspark.reason": why})
            log.warning("request %s lost verifier %s after %d tokens (%s); resuming elsewhere",
                        request.request_id, address, len(streamed), why)
            if lost > self.max_resumes:
                yield pb.GenerateChunk(request_id=request.request_id, offset=len(streamed),
                                       finish_reason=pb.FINISH_REASON_ERROR, error=f"gave up after {lost} verifier losses")
                return

    async def _relay(self, chunks, streamed: list[int], text: list[str], has_peer):
        async for chunk in chunks:
            if chunk.offset != len(streamed):  # never relay a duplicate or leave a gap
                raise VerifierLost(f"chunk at offset {chunk.offset}, expected {len(streamed)}")
            if chunk.finish_reason == pb.FINISH_REASON_CANCELLED and has_peer():
                # The verifier is shutting down: keep its tokens, finish elsewhere.
                if chunk.token_ids:
                    streamed.extend(chunk.token_ids)
                    text.append(chunk.text)
                    chunk.ClearField("finish_reason")
                    chunk.ClearField("metrics")
                    yield chunk
                raise VerifierLost("verifier cancelled the request (shutting down)")
            streamed.extend(chunk.token_ids)
            text.append(chunk.text)
            yield chunk

    async def ListModels(self, request, context):
        seen = {}
        for r in self.registry.live():
            seen.setdefault(r["model"], pb.ModelInfo(name=r["model"], drafter=r.get("drafter_kind", ""),
                                                     gamma=r.get("gamma", 0),
                                                     max_context_tokens=r.get("max_context_tokens", 0)))
        return pb.ListModelsResponse(models=list(seen.values()))


def record_from_load(load: load_pb2.VerifierLoad) -> dict:
    return dict(verifier_id=load.verifier_id, running=load.running, queued=load.queued, kv_use=load.kv_use,
                verify_budget=load.verify_budget, max_batch=load.max_batch, max_context_tokens=load.max_context_tokens,
                model=load.model, sps=[[p.batch_tokens, p.step_seconds] for p in load.sps],
                draft_cost=[[p.requests, p.seconds] for p in load.draft_cost],
                calibration_version=load.calibration_version)


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    """Verifiers report here. Answers come back at once: the store is written in the background."""

    def __init__(self, registry: Registry, planner: BudgetPlanner | None = None,
                 calibrator: OnlineCalibrator | None = None, address_check: bool = True):
        self.registry, self.address_check = registry, address_check
        self.planner = planner or BudgetPlanner()
        self.calibrator = calibrator
        self.priors: dict[str, np.ndarray] = {}  # drafter version -> its shipped STS temperatures
        if calibrator is not None:
            calibrator.priors = self.priors  # positions with too few live outcomes keep these

    def _decision(self, verifier_id: str, drafter_version: str = "") -> load_pb2.BudgetDecision:
        """The verify budget by the two-step rule once this verifier reported confidences
        (decided=False: keep yours), and the newest temperatures of its drafter version."""
        budget = self.planner.budgets.get(verifier_id)
        decision = load_pb2.BudgetDecision(verify_budget=budget or 0, decided=budget is not None,
                                           min_draft_gain=self.planner.min_gain)
        if not drafter_version:
            drafter_version = (self.registry.by_id(verifier_id) or {}).get("drafter_version", "")
        calibration = self.calibrator.calibration(drafter_version) if self.calibrator and drafter_version else None
        if calibration is not None:
            decision.calibration.CopyFrom(calibration)
        return decision

    def _temperatures(self, drafter_version: str):
        """The online fit's temperatures, else the drafter's shipped ones, else None (T = 1)."""
        fit = self.calibrator.fits.get(drafter_version) if self.calibrator else None
        return self.priors.get(drafter_version) if fit is None else fit.temperatures

    async def RegisterVerifier(self, request, context):
        if not request.address or not request.load.verifier_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address and load.verifier_id are required")
        if request.HasField("sts_temperatures"):
            try:
                prior = tensor_from_proto(request.sts_temperatures, torch.float32, (request.gamma,)).double().numpy()
            except WireError as error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sts_temperatures: {error}")
            if not np.all(prior > 0):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sts_temperatures must be positive")
        identity, peer = caller_identity(context), peer_host(context.peer())
        existing = self.registry.by_id(request.load.verifier_id)
        refusal = registration_refusal(existing, existing is not None and self.registry.is_live(existing),
                                       request.address, identity, peer, self.address_check)
        if refusal:
            log.warning("registration of %r at %s from %s refused: %s", request.load.verifier_id, request.address,
                        context.peer(), refusal)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        if request.HasField("sts_temperatures"):
            self.priors[request.drafter_version] = prior
        record = record_from_load(request.load)
        record.update(address=request.address, model=request.model or record["model"],
                      drafter_kind=request.drafter_kind, drafter_version=request.drafter_version, gamma=request.gamma,
                      identity=identity, peer=peer)
        self.registry.revive(request.address)
        self.registry.heartbeat(record)
        self.planner.forget(record["verifier_id"])
        log.info("verifier %s registered at %s (%s)", record["verifier_id"], request.address, record["model"])
        return self._decision(record["verifier_id"], request.drafter_version)

    async def Heartbeat(self, request, context):
        known = self.registry.by_id(request.load.verifier_id)
        if known is None:  # we lost it (restart with an empty store): make it register again
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown verifier: register first")
        await self._check_caller(known, context)
        self.registry.heartbeat(dict(known, **record_from_load(request.load)))
        return self._decision(request.load.verifier_id)

    async def _check_caller(self, record: dict, context) -> None:
        refusal = caller_refusal(record, caller_identity(context), peer_host(context.peer()))
        if refusal:
            log.warning("call from %s for verifier %r refused: %s", context.peer(), record.get("verifier_id"), refusal)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)

    async def ReportStep(self, request, context):
        return await self._report(request.verifier_id, request.drafter_version, [request], context)

    async def ReportSteps(self, request, context):
        steps = list(request.steps)
        if not steps:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no steps")
        if any((s.verifier_id, s.drafter_version) != (steps[0].verifier_id, steps[0].drafter_version) for s in steps):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "steps of one verifier and drafter version only")
        return await self._report(steps[0].verifier_id, steps[0].drafter_version, steps, context)

    async def _report(self, verifier_id: str, drafter_version: str, steps: list, context):
        """Steps of one verifier, oldest first: their outcomes, their times, their newest confidences."""
        known = self.registry.by_id(verifier_id)
        if known is not None:  # unknown = registered at another replica moments ago: not ours to judge yet
            await self._check_caller(known, context)
        known = known or {}
        try:
            confs = [step_confidences(s.confidence_logits, s.accepted_len, s.verified_len)
                     if s.HasField("confidence_logits") else None for s in steps]
            # Outcomes: each step's verified drafts, then earlier unverified ones the target has decided since.
            outcomes = []
            for s, conf in zip(steps, confs):
                outcomes.append((conf, s.accepted_len, s.verified_len))
                if s.HasField("checked_confidence_logits"):
                    outcomes.append((step_confidences(s.checked_confidence_logits, s.checked_accepted_len,
                                                      s.checked_verified_len),
                                     s.checked_accepted_len, s.checked_verified_len))
        except WireError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"confidence logits: {error}")
        self._count_outcomes(drafter_version, steps)
        temperatures = self._temperatures(drafter_version)
        self._learn(verifier_id, drafter_version, temperatures, [o for o in outcomes if o[0] is not None and any(o[2])])
        sps, draft_cost = known.get("sps", []), known.get("draft_cost", [])
        for s in steps:  # the draft-cost table is by the rows the drafter drafted: lookup's are not in a report
            self.planner.observe_step(verifier_id, len(s.verified_len), s.batch_tokens, s.step_latency_s,
                                      any(s.verified_len) and not s.draft_resumed, sps, draft_cost)
        # Every report of the call joins the budget's pool, then the budget is computed once, for the
        # newest report's step: its batch, of which the report's rows are the drafter's (or a sample of
        # sample_of rows that are).
        drafted = [(s, conf) for s, conf in zip(steps, confs) if conf is not None]
        newest = drafted[-1][0] if drafted else None
        self.planner.on_reports(verifier_id, [(s.step, conf) for s, conf in drafted], temperatures, sps, draft_cost,
                                newest.batch_size if newest else 0, newest.sample_of if newest else 0)
        return self._decision(verifier_id, drafter_version)

    def _count_outcomes(self, drafter_version: str, steps: list) -> None:
        drafted = [s for s in steps if s.verified_len]
        if drafted:
            counts = {"steps": len(drafted), "drafts": sum(len(s.verified_len) for s in drafted),
                      "verified": sum(sum(s.verified_len) for s in drafted),
                      "accepted": sum(sum(s.accepted_len) for s in drafted)}
            self.registry.background(self.registry.store.add_outcomes(drafter_version or "none", counts))

    def _learn(self, verifier_id: str, drafter_version: str, temperatures, outcomes: list) -> None:
        """Decided drafts of several steps at once: the calibration's histograms and the live offset's
        window keep rows, so rows of several steps together land where step by step would."""
        for gamma in dict.fromkeys(logits.shape[1] for logits, _, _ in outcomes):  # one drafter: one gamma
            group = [o for o in outcomes if o[0].shape[1] == gamma]
            logits = np.concatenate([o[0] for o in group])
            accepted = [a for _, acc, _ in group for a in acc]
            verified = [v for _, _, ver in group for v in ver]
            if self.calibrator is not None and drafter_version:
                self.calibrator.add(drafter_version, logits, accepted, verified, reports=len(group))
            self.planner.learn(verifier_id, logits, temperatures, accepted, verified)


def step_confidences(logits, accepted_len, verified_len) -> np.ndarray:
    """A StepReport's confidence logits (of its batch, or its checked rows) as float64 [R, gamma],
    checked against their length lists."""
    rows = len(verified_len)
    conf = tensor_from_proto(logits, torch.float32, (rows, None)).double().numpy()
    if len(accepted_len) != rows:
        raise WireError(f"{len(accepted_len)} accepted_len for {rows} verified_len")
    if any(a > v or v > conf.shape[1] for a, v in zip(accepted_len, verified_len)):
        raise WireError("need accepted_len <= verified_len <= gamma per row")
    if not np.all(np.isfinite(conf)):
        raise WireError("confidence logits must be finite")
    return conf
