"""The verifier's admission policy under the scheduler (DESIGN.md 1.4, two-step rule).

ConfidencePolicy does the admission: the top-K draft tokens by current calibrated prefix
survival, within each request's cap (its SpeculationOverride, the room left). K and the STS
temperatures come from the scheduler, which computes them off the critical path from what this
verifier reported earlier; they arrive with the replies to its reports and heartbeats (or a
SetCapacity push) and are only ever read here, never waited for.

Fallback: a K stays in force while it is fresh; once the scheduler has been silent for more
than `ttl_steps` steps *and* `ttl_s` seconds (both, so neither a fast engine nor an idle one
drops a good K early), the policy falls back to the static default: static_k draft tokens per
running request (the --k flag), admitted by survival like any other K. A drafter without
confidences (DFlash, EAGLE-3) always gets the fixed static_k per request.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from dspark.spec.confidence_policy import ConfidencePolicy
from dspark.wire import WireError, tensor_from_proto

log = logging.getLogger(__name__)


class ScheduledPolicy(ConfidencePolicy):
    def __init__(self, sps, static_k: int, gamma: int, drafter_version: str = "", explore: float = 0.0,
                 ttl_steps: int = 100, ttl_s: float = 5.0, seed: int = 0, clock=time.monotonic,
                 probe_every: int = 16):
        super().__init__(sps, None, static_k=static_k, explore=explore, seed=seed, probe_every=probe_every)
        self.gamma, self.drafter_version = gamma, drafter_version
        self.ttl_steps, self.ttl_s, self.clock = ttl_steps, ttl_s, clock
        self.steps = 0  # policy decisions so far (engine thread)
        self._pushed: tuple[int, int, float] | None = None  # (K, at step, at time), replaced whole
        self.calibration_version = 0
        self.from_scheduler = False  # whether the last decision used the scheduler's K

    # ---- from the scheduler (asyncio thread; single assignments, read by the engine thread) --
    def set_capacity(self, k: int | None) -> None:
        self._pushed = None if k is None else (int(k), self.steps, self.clock())

    def apply(self, capacity) -> None:
        """Take a load_pb2.Capacity: K when it is a decision, temperatures when newer."""
        if capacity.decided:
            self.set_capacity(capacity.k)
        if capacity.HasField("calibration"):
            self.set_calibration(capacity.calibration)

    def set_calibration(self, calibration) -> bool:
        if calibration.version <= self.calibration_version or calibration.drafter_version != self.drafter_version:
            return False
        try:
            temperatures = tensor_from_proto(calibration.temperatures, torch.float32, (self.gamma,)).double().numpy()
        except WireError as error:
            log.warning("ignoring calibration v%d: %s", calibration.version, error)
            return False
        if not np.all(temperatures > 0):
            log.warning("ignoring calibration v%d: temperatures must be positive", calibration.version)
            return False
        self.temperatures = temperatures
        self.calibration_version = int(calibration.version)
        log.info("STS temperatures v%d in force: %s", self.calibration_version, np.round(temperatures, 3).tolist())
        return True

    # ---- engine thread -------------------------------------------------------------------------
    def scheduled_k(self) -> int | None:
        """The scheduler's last K while it is still in force, else None."""
        pushed = self._pushed
        if pushed is None:
            return None
        k, at_step, at_time = pushed
        if self.steps - at_step > self.ttl_steps and self.clock() - at_time > self.ttl_s:
            return None
        return k

    def capacity(self, num_requests: int) -> int:
        k = self.scheduled_k()
        self.from_scheduler = k is not None
        return k if k is not None else self.static_k * num_requests

    def next_capacity(self, num_requests: int) -> int:
        return self.capacity(num_requests)  # the scheduler's K is already the newest knowledge

    def should_draft(self, num_requests: int) -> bool:
        draft = super().should_draft(num_requests)
        if not draft:
            self.steps += 1  # a drafted step counts in lengths(), a skipped one here
            self.last_k = 0
        return draft

    def lengths(self, block, caps: list[int]) -> list[int]:
        self.steps += 1
        if block is None or block.conf_logits is None:
            self.from_scheduler = False
            self.last_k = self.static_k * len(caps)
        return super().lengths(block, caps)
