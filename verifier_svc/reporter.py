"""Verifier -> scheduler reports, off the critical path (method.md 6, step 7).

The engine thread only appends its step reports to a bounded deque (never blocks, drops the
oldest when the scheduler is slow); an asyncio task registers, heartbeats the load every
~0.5 s and looks at the step reports every ~50 ms, sending all steps since the last flush in one
ReportSteps call once they are worth a call (`flush_due`): as many drafted blocks as the
scheduler pools for a budget, a probe's confidences (the way back to drafting while it is off),
or ~0.25 s since the last. (Flushed with the heartbeat, a budget was up to 25 steps old at one
request: the first half second of a request drafted on the fallback length whatever its drafts
were worth. A call per step every 20 ms cost a 2-core host 8% of its speculative speed in the
scheduler's CPU and the engine thread's GIL, and a call every 50 ms still ~6% at one request:
the scheduler's ~1.5 ms of CPU a call takes a core from the target's spinning threads.) If the
scheduler is gone, calls fail fast, the reports are dropped and the verifier keeps serving with
the verify budget it last had. `address` may list several scheduler replicas (comma-separated):
after a failed call the next one is tried, and the verifier registers there (they share the
registry through Redis).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time

import grpc
import torch

from dspark.proto_gen.v1 import load_pb2, scheduler_pb2, scheduler_pb2_grpc
from dspark.sched.verify_budget import POOLED_BLOCKS
from dspark.serving.config import aio_channel
from dspark.wire import tensor_to_proto

log = logging.getLogger(__name__)
FLUSH_MAX_S = 0.25


def flush_due(blocks: int, probe: bool, since_flush_s: float, min_blocks: int = POOLED_BLOCKS,
              max_wait_s: float = FLUSH_MAX_S) -> bool:
    """Whether the pending step reports are worth a ReportSteps call now: they hold `blocks` drafted
    blocks (one a request a drafted step), `probe` says one of them drafted without verifying (a
    probe while the budget is 0: its confidences are what can turn drafting back on), and the last
    call was `since_flush_s` ago. Fewer blocks than the scheduler pools move its budget little; at
    16 requests one step holds them all."""
    return probe or blocks >= min_blocks or since_flush_s >= max_wait_s


class SchedulerReporter:
    def __init__(self, address: str, register: scheduler_pb2.RegisterVerifierRequest, load_fn, on_decision,
                 interval_s: float = 0.5, max_message_mb: float = 16, step_interval_s: float = 0.05,
                 flush_blocks: int = POOLED_BLOCKS, flush_max_s: float = FLUSH_MAX_S):
        self.addresses = [a.strip() for a in address.split(",") if a.strip()]
        self.register, self.load_fn, self.on_decision = register, load_fn, on_decision
        self.interval_s, self.step_interval_s = interval_s, min(step_interval_s, interval_s)
        self.flush_blocks, self.flush_max_s = flush_blocks, max(flush_max_s, self.step_interval_s)
        self.channels = [aio_channel(a, max_message_mb) for a in self.addresses]
        self._current = 0
        self.reports: collections.deque = collections.deque(maxlen=512)
        self._task: asyncio.Task | None = None
        self._steps = 0

    def on_step(self, step_report, drafter_version: str = "") -> None:
        """Engine thread: remember the step (deque.append is thread-safe)."""
        self._steps += 1
        # Steps with drafts or checked outcomes only: the others carry no labels or confidences.
        if step_report.req_ids or step_report.checked_conf is not None:
            self.reports.append((self._steps, step_report, drafter_version))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def address(self) -> str:
        return self.addresses[self._current]

    @property
    def stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        return scheduler_pb2_grpc.SchedulerStub(self.channels[self._current])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for channel in self.channels:
            await channel.close()

    def _step_proto(self, step: int, r, drafter_version: str) -> scheduler_pb2.StepReport:
        msg = scheduler_pb2.StepReport(
            verifier_id=self.register.load.verifier_id, step=step, batch_size=r.batch_size,
            batch_tokens=r.batch_tokens, step_latency_s=r.seconds, drafter_version=drafter_version,
            verified_len=r.verified, accepted_len=r.accepted, sample_of=r.sample_of, draft_resumed=r.draft_resumed)
        if r.conf_logits is not None:
            msg.confidence_logits.CopyFrom(tensor_to_proto(r.conf_logits.to(torch.float32)))
        if r.checked_conf is not None:
            msg.checked_confidence_logits.CopyFrom(tensor_to_proto(r.checked_conf.to(torch.float32)))
            msg.checked_verified_len.extend(r.checked_verified)
            msg.checked_accepted_len.extend(r.checked_accepted)
        return msg

    def _due(self, pending: list, since_flush_s: float) -> bool:
        blocks = sum(len(report.req_ids) for _, report, _ in pending)
        probe = any(report.req_ids and not any(report.verified) for _, report, _ in pending)
        return flush_due(blocks, probe, since_flush_s, self.flush_blocks, self.flush_max_s)

    async def _flush(self, batch: list) -> None:
        for version in dict.fromkeys(item[2] for item in batch):  # one drafter version, but for a swap
            steps = [self._step_proto(*item) for item in batch if item[2] == version]
            # One call for every step since the last flush (a call per step: see the module doc).
            decision = await self.stub.ReportSteps(scheduler_pb2.StepReports(steps=steps), timeout=1.0)
            self.on_decision(decision)  # the budget from the newest confidences, newest temperatures

    async def _run(self) -> None:
        registered, next_heartbeat, last_flush = False, 0.0, 0.0
        while True:
            delay = self.step_interval_s
            try:
                if not registered or time.monotonic() >= next_heartbeat:
                    next_heartbeat = time.monotonic() + self.interval_s
                    load = self.load_fn()
                    if not registered:
                        self.register.load.CopyFrom(load)
                        decision = await self.stub.RegisterVerifier(self.register, timeout=1.0)
                        registered = True
                        log.info("registered with the scheduler at %s", self.address)
                    else:
                        decision = await self.stub.Heartbeat(scheduler_pb2.HeartbeatRequest(load=load), timeout=1.0)
                    self.on_decision(decision)
                pending = list(self.reports)  # the engine thread may append meanwhile: those wait
                if pending and self._due(pending, time.monotonic() - last_flush):
                    last_flush = time.monotonic()
                    await self._flush([self.reports.popleft() for _ in pending])
            except grpc.aio.AioRpcError as error:
                delay = self.interval_s  # not every 50 ms against a scheduler that is away
                if registered:
                    log.warning("scheduler at %s unreachable (%s); still serving", self.address, error.code().name)
                registered = False  # re-register once it is back (it may have lost its state) ...
                self.reports.clear()
                self._current = (self._current + 1) % len(self.addresses)  # ... or with the next replica
            except Exception:
                delay = self.interval_s
                log.exception("scheduler report failed")
            await asyncio.sleep(delay)


def make_load(verifier_id: str, runner, max_batch: int, max_len: int, model: str) -> load_pb2.VerifierLoad:
    return load_pb2.VerifierLoad(verifier_id=verifier_id, running=runner.running, queued=runner.queued,
                                 kv_use=runner.kv_use(), max_batch=max_batch,
                                 max_context_tokens=max_len, model=model)
