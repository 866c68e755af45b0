"""The verifier's side of confidence scheduling: the policy, the SPS table, what goes to the
scheduler and what comes back. Kept out of __main__ so the wiring there stays a few lines.

  make_policy   ScheduledPolicy for a drafter (FixedK(0) without one)
  warmup        SPS warm-up profile before SERVING (sps_profile.py)
  fill_load     K in force, SPS table and calibration version into VerifierLoad
  apply         a Capacity reply or SetCapacity push: K, temperatures (never waited for)
  on_step       live step time into the SPS table, capacity metrics (engine thread, cheap)
"""
from __future__ import annotations

import asyncio
import logging

from dspark.serving import metrics
from dspark.spec.policy import FixedK
from verifier_svc.scheduled_policy import ScheduledPolicy
from verifier_svc.sps_profile import LiveSps, warmup_profile

log = logging.getLogger(__name__)


def shipped_temperatures(drafter):
    """The drafter checkpoint's offline STS fit (calibration.json), or None (T = 1)."""
    return getattr(drafter, "sts_temperatures", None)


class CapacityControl:
    def __init__(self, explore: float = 0.0, ttl_steps: int = 100, ttl_s: float = 5.0, warmup_s: float = 10.0,
                 probe_every: int = 16):
        """probe_every: while K = 0, draft only every probe_every-th step (1 = draft every step;
        the drafting cost is then sunk and not published for the scheduler to weigh)."""
        self.explore, self.ttl_steps, self.ttl_s, self.warmup_s = explore, ttl_steps, ttl_s, warmup_s
        self.probe_every = probe_every
        self.sps = LiveSps()  # target step seconds by batch tokens B, drafting excluded
        self.draft_cost = LiveSps()  # seconds drafting adds, by running requests R
        self.policy: ScheduledPolicy | FixedK | None = None
        self.drafter = None

    def make_policy(self, drafter, static_k: int, scheduled: bool = True):
        """ScheduledPolicy (the scheduler's K, static_k as the fallback), or FixedK(static_k)
        when not scheduled; FixedK(0) without a drafter."""
        self.drafter = drafter
        if drafter is None or not scheduled:
            self.policy = FixedK(static_k if drafter is not None else 0)
        else:
            self.policy = ScheduledPolicy(self.sps, static_k, drafter.gamma, drafter.version, self.explore,
                                          self.ttl_steps, self.ttl_s, probe_every=self.probe_every)
            self.policy.last_k = static_k
            self.policy.temperatures = shipped_temperatures(drafter)  # until the online fit arrives
        return self.policy

    async def warmup(self, engine, max_batch: int) -> None:
        gamma = self.drafter.gamma if self.drafter is not None else 0
        if self.warmup_s > 0:
            table = await asyncio.to_thread(warmup_profile, engine, max_batch * (1 + gamma), budget_s=self.warmup_s)
            self.sps.table.seconds_by_tokens.update(table.seconds_by_tokens)
            metrics.SPS_POINTS.set(len(table.seconds_by_tokens))

    @property
    def k_in_force(self) -> int:
        policy = self.policy
        if isinstance(policy, ScheduledPolicy):
            return int(policy.last_k or 0)
        return policy.k if policy is not None else 0

    def fill_load(self, load):
        load.capacity = self.k_in_force
        load.sps.extend(self.sps.points())
        if self.probe_every > 1:  # K = 0 saves the drafting only when drafting can be skipped
            load.draft_cost.extend(self.draft_cost.draft_cost_points())
        if isinstance(self.policy, ScheduledPolicy):
            load.calibration_version = self.policy.calibration_version
        return load

    def apply(self, capacity) -> None:
        if isinstance(self.policy, ScheduledPolicy):
            self.policy.apply(capacity)

    def on_step(self, report) -> None:
        # Pure decode steps only (no prompt in the pass): B = requests + drafts verified.
        if report.batch_tokens == report.batch_size + sum(report.verified) and report.seconds > 0:
            drafting = report.draft_seconds if report.drafted else 0.0
            self.sps.observe(report.batch_tokens, report.seconds - drafting)
            if report.drafted:
                self.draft_cost.observe(report.batch_size, report.draft_seconds)
            elif report.req_ids == [] and self.drafter is not None and report.batch_size:
                metrics.DRAFT_SKIPPED_STEPS.inc()
        for n in report.verified:
            metrics.VERIFIED_PER_REQUEST.observe(n)
        policy = self.policy
        if isinstance(policy, ScheduledPolicy):
            if self.drafter.version != policy.drafter_version:  # a new checkpoint: its own calibration
                log.info("drafter version %s -> %s: temperatures reset", policy.drafter_version, self.drafter.version)
                policy.drafter_version, policy.calibration_version = self.drafter.version, 0
                policy.temperatures = shipped_temperatures(self.drafter)
            metrics.CAPACITY_K.set(self.k_in_force)
            metrics.CAPACITY_FROM_SCHEDULER.set(int(policy.from_scheduler))
