"""Confidence-scheduled verification lengths (DESIGN.md 1.4, the two-step rule).

Capacity K for a step comes from the calibrated prefix survivals of two steps earlier (or from
the scheduler service, which computes it off the critical path); the tokens admitted are the
top-K current drafts by calibrated prefix survival. K never depends on the current drafts and a
token never outranks its own prefix, so the output stays exactly the target's.

K = 0 means drafting does not pay for itself (weak drafts, or a batch large enough that the
target is compute-bound): the next steps skip the drafter entirely, plain decoding, except for a
probe after `probe_every` skipped steps, whose drafts refresh the confidences K is computed from.
While probes keep finding K = 0 the gap between them doubles, up to 4 x probe_every, so a
steady "no" costs little; any K > 0 resets it. Whether to draft is decided from older
confidences only, so skipping cannot bias the output either.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from dspark.sched.calibration import apply_sts
from dspark.sched.prefix_scheduler import admit_top_k, capacity_from_confidences, prefix_survival


class ConfidencePolicy:
    def __init__(self, sps, temperatures=None, static_k: int = 3, explore: float = 0.0, seed: int = 0,
                 draft_cost=None, probe_every: int = 16):
        """sps: callable B -> steps/s of a step without drafting; draft_cost: callable R -> seconds
        drafting adds for R requests (None: free); static_k: per-request draft tokens used until
        two steps of confidences exist (and when no capacity is known); explore: share of requests
        that verify their full block anyway, so low-confidence tails keep getting labels."""
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.sps, self.draft_cost, self.probe_every = sps, draft_cost, probe_every
        self.skipped = 0  # steps skipped since the last draft
        self.probe_interval = probe_every  # skipped steps before the next probe
        self.temperatures = None if temperatures is None else np.asarray(temperatures, dtype=np.float64)
        self.static_k, self.explore = static_k, explore
        self.rng = np.random.default_rng(seed)
        self.history: deque[np.ndarray] = deque(maxlen=2)
        self.external_k: int | None = None  # pushed by the scheduler service
        self.last_k: int | None = None

    def set_capacity(self, k: int | None) -> None:
        self.external_k = k

    def calibrated_survival(self, conf_logits) -> np.ndarray:
        if hasattr(conf_logits, "cpu"):  # a tensor, maybe on a GPU: one copy to the host
            conf_logits = conf_logits.float().cpu().numpy()
        z = np.asarray(conf_logits, dtype=np.float64)
        conf = apply_sts(z, self.temperatures) if self.temperatures is not None else 1 / (1 + np.exp(-z))
        return prefix_survival(conf)

    def _capacity_from(self, a: np.ndarray) -> int:
        draft_seconds = float(self.draft_cost(a.shape[0])) if self.draft_cost is not None else 0.0
        return capacity_from_confidences(a, self.sps, draft_seconds)

    def capacity(self, num_requests: int) -> int:
        if self.external_k is not None:
            return self.external_k
        if self.history:  # two drafts old once there are two (one draft old before that)
            return self._capacity_from(self.history[0])
        return self.static_k * num_requests

    def next_capacity(self, num_requests: int) -> int:
        """K as the newest confidences (at least a step old) put it, for the skip decision."""
        if self.external_k is not None:
            return self.external_k
        if self.history:
            return self._capacity_from(self.history[-1])
        return self.static_k * num_requests

    def should_draft(self, num_requests: int) -> bool:
        if self.probe_every == 1 or self.next_capacity(num_requests) > 0:
            self.skipped, self.probe_interval = 0, self.probe_every
            return True
        self.skipped += 1
        if self.skipped < self.probe_interval:
            return False
        self.skipped = 0  # a probe; should it find K = 0 again, the next one waits longer
        self.probe_interval = min(2 * self.probe_interval, 4 * self.probe_every)
        return True

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
