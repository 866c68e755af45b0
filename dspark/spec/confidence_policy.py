"""Confidence-scheduled verification lengths (DESIGN.md 1.4, the two-step rule).

Capacity K for a step comes from the calibrated prefix survivals of two steps earlier (or from
the scheduler service, which computes it off the critical path); the tokens admitted are the
top-K current drafts by calibrated prefix survival. K never depends on the current drafts and a
token never outranks its own prefix, so the output stays exactly the target's.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from dspark.sched.calibration import apply_sts
from dspark.sched.prefix_scheduler import admit_top_k, capacity_from_confidences, prefix_survival


class ConfidencePolicy:
    def __init__(self, sps, temperatures=None, static_k: int = 3, explore: float = 0.0, seed: int = 0):
        """sps: callable B -> steps/s of the whole step; static_k: per-request draft tokens used
        until two steps of confidences exist (and when no capacity is known); explore: share of
        requests that verify their full block anyway, so low-confidence tails keep getting labels."""
        self.sps = sps
        self.temperatures = None if temperatures is None else np.asarray(temperatures, dtype=np.float64)
        self.static_k, self.explore = static_k, explore
        self.rng = np.random.default_rng(seed)
        self.history: deque[np.ndarray] = deque(maxlen=2)
        self.external_k: int | None = None  # pushed by the scheduler service
        self.last_k: int | None = None

    def set_capacity(self, k: int | None) -> None:
        self.external_k = k

    def calibrated_survival(self, conf_logits) -> np.ndarray:
        z = np.asarray(conf_logits, dtype=np.float64)
        conf = apply_sts(z, self.temperatures) if self.temperatures is not None else 1 / (1 + np.exp(-z))
        return prefix_survival(conf)

    def capacity(self, num_requests: int) -> int:
        if self.external_k is not None:
            return self.external_k
        if len(self.history) == 2:
            return capacity_from_confidences(self.history[0], self.sps)  # two steps old
        return self.static_k * num_requests

    def lengths(self, block, caps: list[int]) -> list[int]:
        if block is None or block.conf_logits is None:  # no confidences: fixed length
            return [min(self.static_k, c) for c in caps]
        a = self.calibrated_survival(block.conf_logits)
        k = self.capacity(len(caps))
        self.last_k = k
        self.history.append(a)  # used two steps from now
        lengths = admit_top_k(a, k, np.asarray(caps))
        if self.explore > 0:
            # Chosen independently of the drafts, so exploring cannot bias the output.
            full = self.rng.random(len(caps)) < self.explore
            lengths = np.where(full, np.asarray(caps), lengths)
        return [int(x) for x in lengths]
