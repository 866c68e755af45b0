"""The verifier's SPS table (docs/method.md): seconds of a step without drafting per batch-token
count B, and the draft-cost table: seconds drafting adds per number of requests R.

At start, before the verifier reports SERVING, `warmup_profile` times a few target passes at
B = 1, 2, 4, ... up to the most tokens one step can carry (max batch x (1 + gamma)), on the
verifier's own KV cache and model, within a small time budget. Live steps then fold their real
times into both tables with `SpsTable.observe` (the step minus its drafting into the SPS table,
the drafting into the draft-cost table), so they soon measure what the scheduler needs.
`LiveSps` is the thread-safe holder: the engine thread observes, the load reporter reads.
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from dspark.device import synchronize
from dspark.models.batch import VarlenBatch
from dspark.proto_gen.v1 import load_pb2
from dspark.sched.sps import SpsTable

log = logging.getLogger(__name__)


def profile_token_counts(max_tokens: int) -> list[int]:
    """1, 2, 4, ... below max_tokens, then max_tokens itself."""
    counts, b = [], 1
    while b < max_tokens:
        counts.append(b)
        b *= 2
    return counts + [max(1, int(max_tokens))]


@torch.no_grad()
def warmup_profile(engine, max_tokens: int, repeats: int = 3, budget_s: float = 10.0,
                   context: int = 16) -> SpsTable:
    """Median seconds of `repeats` target passes per B, spread over up to max-batch requests
    (each with a short context already cached), the way a verification step lays them out.
    Stops early (keeping what it measured) once `budget_s` is spent. Leaves the cache empty."""
    cache, vocab = engine.cache, engine.model.config.vocab_size
    capture = engine.capture_layers
    slots = [cache.allocate() for _ in range(cache.num_free)]
    seconds: dict[int, float] = {}
    started = time.perf_counter()
    try:
        if not slots:
            return SpsTable()
        prefix = [[(7 * s + i) % vocab for i in range(context)] for s in range(len(slots))]
        device = engine.model.device
        engine.model(VarlenBatch.build(prefix, [0] * len(slots), slots, device=device), cache, logits_rows=None)
        for b in profile_token_counts(max_tokens):
            num_seqs = min(b, len(slots))
            lens = [b // num_seqs + (i < b % num_seqs) for i in range(num_seqs)]
            batch = VarlenBatch.build([[(3 * i + j) % vocab for j in range(n)] for i, n in enumerate(lens)],
                                      [context] * num_seqs, slots[:num_seqs], device=device)
            samples = []
            for _ in range(repeats + 1):  # the first pass at a new shape is a warm-up
                t0 = time.perf_counter()
                engine.model(batch, cache, capture_layers=capture, logits_rows="all")
                synchronize(device)  # a GPU pass is only queued when the call returns
                samples.append(time.perf_counter() - t0)
                for slot in slots[:num_seqs]:
                    cache.rollback(slot, context)
            seconds[b] = float(np.median(samples[1:]))
            if time.perf_counter() - started > budget_s:
                log.warning("SPS warm-up stopped at B=%d: over its %.1f s budget", b, budget_s)
                break
    finally:
        for slot in slots:
            cache.free(slot)
    log.info("SPS warm-up profile (B: steps/s) %s in %.2f s",
             {b: round(1 / s, 1) for b, s in seconds.items()}, time.perf_counter() - started)
    return SpsTable(seconds)


class LiveSps:
    """An SpsTable shared between the engine thread (observe) and the reporter (points)."""

    def __init__(self, table: SpsTable | None = None):
        self.table = table or SpsTable()
        self._lock = threading.Lock()

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens >= 1 and seconds > 0:
            with self._lock:
                self.table.observe(tokens, seconds)

    def update(self, table: SpsTable) -> None:
        """Take every point a profile measured (the warm-up's), replacing what was there; live
        steps then set their level (SpsTable.set_profile)."""
        with self._lock:
            self.table.set_profile(table.seconds_by_tokens)

    def __call__(self, tokens):
        with self._lock:
            return self.table(tokens)

    def items(self) -> list[tuple[int, float]]:
        """(count, seconds), ascending count."""
        with self._lock:
            return sorted(self.table.seconds_by_tokens.items())

    def points(self) -> list[load_pb2.SpsPoint]:
        """The table for VerifierLoad.sps, ascending B."""
        return [load_pb2.SpsPoint(batch_tokens=b, step_seconds=s) for b, s in self.items()]

    def draft_cost_points(self) -> list[load_pb2.DraftCostPoint]:
        """This table read as a draft-cost table (count = requests), for VerifierLoad.draft_cost."""
        return [load_pb2.DraftCostPoint(requests=r, seconds=s) for r, s in self.items()]
