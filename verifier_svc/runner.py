"""The engine thread: SpecEngine's step loop, fed by a thread-safe inbox.

gRPC handlers (asyncio) submit jobs and cancel them; the thread admits them between steps, runs
steps while there is work, and hands each job's new tokens back to its handler's event loop
with call_soon_threadsafe. Step reports go to a callback that must not block.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from dspark.speculative.engine import EngineRequest, SpecEngine
from dspark.speculative.metrics import SpecMetrics

log = logging.getLogger(__name__)
ADMISSION_QUIET_S = 0.002  # an idle engine admits arrivals that follow each other this closely together,
ADMISSION_WINDOW_S = 0.02  # for at most this long after the first


@dataclass
class Event:
    tokens: list[int]
    finish: str | None = None  # dspark.engine.sequence.FinishReason value once done
    metrics: SpecMetrics | None = None  # with finish
    error: str = ""


@dataclass
class Job:
    request: EngineRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # or any put_nowait sink (a shared stream's)
    seq: object = None
    span: object = None  # the request's trace span when tracing is on
    # Tokens are held on the engine thread up to this long between deliveries (the stream's chunk
    # interval, when nothing needs to see every step: no stop strings), so a step does not wake the
    # event loop for tokens it would only hold: ~0.15 ms of CPU a step there, on the cores the
    # engine's threads need (0 = every step).
    hold_s: float = 0.0
    held: list[int] = field(default_factory=list)
    last_delivery: float | None = None

    def deliver(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def release(self, tokens: list[int], now: float, final: bool = False) -> list[int] | None:
        """The tokens to deliver now (held ones first), or None while they are held. The first
        delivery and the last are never held."""
        self.held.extend(tokens)
        if not final and self.last_delivery is not None and now - self.last_delivery < self.hold_s:
            return None
        tokens, self.held, self.last_delivery = self.held, [], now
        return tokens


def _put_all(deliveries: list[tuple[Job, Event]]) -> None:
    for job, event in deliveries:
        job.events.put_nowait(event)


class EngineRunner:
    def __init__(self, engine: SpecEngine, on_step=None, admission_quiet_s: float = ADMISSION_QUIET_S,
                 admission_window_s: float = ADMISSION_WINDOW_S):
        self.engine, self.on_step = engine, on_step
        self.admission_quiet_s, self.admission_window_s = admission_quiet_s, admission_window_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[str, Job] = {}
        self._stop = threading.Event()
        self._inbox_lock = threading.Lock()  # inbox_size changes on the gRPC thread and the engine thread
        self.inbox_size = 0  # submitted, not yet in the engine (read by load reports)
        self.step_spans = None  # verifier_svc.step_spans.StepSpans when tracing is on
        self._loop: concurrent.futures.Future | None = None  # the stepping loop, once started

    def start(self, executor: concurrent.futures.Executor) -> None:
        """Step on `executor`: the process's one torch thread, the one that loaded the model. Every
        thread that runs torch ops gets its own OpenMP team, and an idle team beside the stepping
        one costs ~1.8x a step on a small host (docs/results.md)."""
        self._loop = executor.submit(self._run)

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._loop is not None:
            concurrent.futures.wait([self._loop], timeout=10)

    def submit(self, job: Job) -> None:
        with self._inbox_lock:
            self.inbox_size += 1
        self._inbox.put(("add", job))

    def cancel(self, job: Job) -> None:
        self._inbox.put(("abort", job))

    # ---- load, read from other threads (ints and list lengths: good enough without a lock) --
    @property
    def running(self) -> int:
        return len(self.engine.running)

    @property
    def queued(self) -> int:
        return len(self.engine.waiting) + self.inbox_size

    def kv_use(self) -> float:
        return self.engine.cache.usage()

    # ---- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_work())
            if not self.engine.has_work():
                continue
            spans = self.step_spans
            if spans is not None:
                spans.begin([self._jobs.get(s.req_id) for s in self.engine.running])
            try:
                events = self.engine.step()
            except Exception as error:  # a bug or OOM: fail what is running, keep serving
                log.exception("engine step failed")
                if spans is not None:
                    spans.end([], None, error=str(error))
                self._fail_all(f"engine step failed: {error}")
                continue
            stepped = []  # (job, new tokens), for the step spans
            outbox: dict[asyncio.AbstractEventLoop, list[tuple[Job, Event]]] = {}
            now = time.monotonic()
            for seq, tokens in events:
                job = self._jobs.get(seq.req_id)
                if job is None:
                    continue
                stepped.append((job, tokens))
                if seq.done:
                    del self._jobs[seq.req_id]
                    event = Event(job.release(tokens, now, final=True), seq.finish.value, seq.spec.metrics)
                    outbox.setdefault(job.loop, []).append((job, event))
                elif tokens and (due := job.release(tokens, now)) is not None:
                    outbox.setdefault(job.loop, []).append((job, Event(due)))
            for loop, deliveries in outbox.items():  # one wake-up of each event loop per step, not per request
                loop.call_soon_threadsafe(_put_all, deliveries)
            if spans is not None:
                spans.end(stepped, self.engine.last_report)
            if self.on_step is not None:
                self.on_step(self.engine.last_report)

    def _drain(self, block: bool) -> None:
        """Take what the inbox holds. An idle engine (block) waits for the first arrival, then for
        more while they keep coming (each within admission_quiet_s, admission_window_s in all): a
        burst of requests then prefills in one pass, where the first arrival used to start a pass
        alone and the rest waited for it (16 at once through the scheduler: first tokens 0.1-1.0 s)."""
        try:
            kind, job = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        deadline = time.monotonic() + self.admission_window_s
        while True:
            if kind == "add":
                with self._inbox_lock:
                    self.inbox_size -= 1
                try:
                    job.seq = self.engine.submit(job.request)
                    self._jobs[job.seq.req_id] = job
                except ValueError as error:  # checked before submit; belt and braces
                    job.deliver(Event([], "abort", error=str(error)))
            elif kind == "abort" and job.seq is not None and self._jobs.pop(job.seq.req_id, None) is not None:
                self.engine.abort(job.seq)
            wait = min(self.admission_quiet_s, deadline - time.monotonic()) if block else 0.0
            try:
                kind, job = self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
            except queue.Empty:
                return

    def _fail_all(self, message: str) -> None:
        for job in list(self._jobs.values()):
            if job.seq is not None:
                try:
                    self.engine.abort(job.seq)
                except Exception as error:  # the engine is in a bad state already: fail the job anyway
                    log.warning("abort of %s after a failed step: %s", job.request.req_id, error)
            job.deliver(Event(job.release([], 0.0, final=True), "abort", error=message))
        self._jobs.clear()
