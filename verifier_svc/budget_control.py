"""The verifier's side of confidence scheduling: its policy, its SPS table, what goes to the
scheduler and what comes back. Kept out of __main__ so the wiring there stays a few lines.

  make_policy   ConfidencePolicy on the scheduler's budget (FixedDraftLen when not scheduled)
  warmup        SPS warm-up profile before SERVING (sps_profile.py)
  fill_load     budget in force, SPS table and calibration version into VerifierLoad
  apply         a BudgetDecision reply or SetVerifyBudget push: budget, temperatures (never waited for)
  on_step       live step time into the SPS table, budget metrics (engine thread, cheap)

The budget and the temperatures come from the scheduler, which computes them off the critical
path from what this verifier reported earlier; they are only ever read here, never waited for.
Until the online fit arrives the drafter checkpoint's own calibration.json temperatures apply;
a drafter without confidences (DFlash, EAGLE-3) gets default_draft_len per request.
"""
from __future__ import annotations

import asyncio
import logging

import numpy as np
import torch

from dspark.sched.budget_source import ScheduledBudget
from dspark.serving import metrics
from dspark.speculative.policy import ConfidencePolicy, FixedDraftLen
from dspark.wire import WireError, tensor_from_proto
from verifier_svc.sps_profile import LiveSps, warmup_profile

log = logging.getLogger(__name__)


def shipped_temperatures(drafter):
    """The drafter checkpoint's offline STS fit (calibration.json), or None (T = 1)."""
    return getattr(drafter, "sts_temperatures", None)


class BudgetControl:
    def __init__(self, explore: float = 0.0, ttl_steps: int = 100, ttl_s: float = 5.0, warmup_s: float = 10.0,
                 probe_every: int = 16):
        """probe_every: while the budget is 0, draft only every probe_every-th step (1 = draft every
        step; the drafting cost is then sunk and not published for the scheduler to weigh)."""
        self.explore, self.ttl_steps, self.ttl_s, self.warmup_s = explore, ttl_steps, ttl_s, warmup_s
        self.probe_every = probe_every
        self.sps = LiveSps()  # target step seconds by batch tokens B, drafting excluded
        self.draft_cost = LiveSps()  # seconds drafting adds, by running requests R
        self.policy: ConfidencePolicy | FixedDraftLen = FixedDraftLen(0)
        self.source: ScheduledBudget | None = None  # the scheduler's budget, when scheduled
        self.drafter = None
        self.drafter_version = ""
        self.calibration_version = 0  # of the temperatures in force; 0 = shipped or none

    def make_policy(self, drafter, default_draft_len: int, scheduled: bool = True):
        """ConfidencePolicy on the scheduler's budget (default_draft_len per request as the
        fallback), or FixedDraftLen(default_draft_len) when not scheduled; FixedDraftLen(0)
        without a drafter."""
        self.drafter, self.source = drafter, None
        if drafter is None or not scheduled:
            self.policy = FixedDraftLen(default_draft_len if drafter is not None else 0)
            return self.policy
        self.source = ScheduledBudget(default_draft_len, self.ttl_steps, self.ttl_s)
        # The drafter is remote: a probe runs beside the target, so the first comes at once.
        self.policy = ConfidencePolicy(self.source, shipped_temperatures(drafter), self.explore,
                                       probe_every=self.probe_every, first_probe=1, free_sps=self.sps)
        self.drafter_version, self.calibration_version = drafter.version, 0
        return self.policy

    async def warmup(self, engine, max_batch: int, run=asyncio.to_thread) -> None:
        """Profile the SPS table; `run(fn, *args, **kwargs)` awaits fn off the event loop (the
        verifier passes its torch thread, so the table measures the thread that steps)."""
        gamma = self.drafter.gamma if self.drafter is not None else 0
        if self.warmup_s > 0:
            table = await run(warmup_profile, engine, max_batch * (1 + gamma), budget_s=self.warmup_s)
            self.sps.update(table)
            metrics.SPS_POINTS.set(len(table.seconds_by_tokens))

    def fill_load(self, load):
        load.verify_budget = self.policy.budget_in_force
        load.sps.extend(self.sps.points())
        if self.probe_every > 1:  # a budget of 0 saves the drafting only when drafting can be skipped
            load.draft_cost.extend(self.draft_cost.draft_cost_points())
        load.calibration_version = self.calibration_version
        return load

    # ---- from the scheduler (asyncio thread; single assignments, read by the engine thread) ----
    def apply(self, decision) -> None:
        """Take a load_pb2.BudgetDecision: the budget when it is a decision, temperatures when newer."""
        if self.source is None:
            return  # not scheduled (--schedule=off) or no drafter
        if decision.decided:
            self.source.push(decision.verify_budget)
        if decision.min_draft_gain > 0:
            self.policy.free_min_gain = decision.min_draft_gain
        if decision.HasField("calibration"):
            self.set_calibration(decision.calibration)

    def set_calibration(self, calibration) -> bool:
        if calibration.version <= self.calibration_version or calibration.drafter_version != self.drafter_version:
            return False
        try:
            gamma = self.drafter.gamma
            temperatures = tensor_from_proto(calibration.temperatures, torch.float32, (gamma,)).double().numpy()
        except WireError as error:
            log.warning("ignoring calibration v%d: %s", calibration.version, error)
            return False
        if not np.all(temperatures > 0):
            log.warning("ignoring calibration v%d: temperatures must be positive", calibration.version)
            return False
        self.policy.set_temperatures(temperatures)
        self.calibration_version = int(calibration.version)
        log.info("STS temperatures v%d in force: %s", self.calibration_version, np.round(temperatures, 3).tolist())
        return True

    # ---- engine thread -------------------------------------------------------------------------
    def on_step(self, report) -> None:
        # Decode steps only (no prompt in the pass): B = requests + drafts verified, the drafter's
        # and prompt lookup's alike, so the table learns what verifying lookup's guesses costs.
        if not report.prefill and report.seconds > 0:
            drafting = report.draft_seconds if report.drafted else 0.0
            self.sps.observe(report.batch_tokens, report.seconds - drafting)
            # The draft-cost table holds what the drafter's model adds to a step while drafting goes on,
            # by the rows it drafted: a drafted step after a drafted one, taking in at most a block and
            # its bonus token a request. Rows that prompt lookup filled skip the model (0.2 ms where a
            # draft is 1.8, one request): counted as drafts, they halved the table and the scheduler
            # stopped drafting where drafting paid. The first draft after skipped steps first takes in
            # every position it missed (a whole prompt: 57 ms where a draft is 12), or waits for a
            # probe still running (94 ms at 4 requests where a draft is 22): such samples once made
            # drafting look too dear to ever resume.
            drafter_rows = len(report.req_ids)  # lookup's rows are not in the report
            if report.drafted and drafter_rows and not report.draft_resumed:
                self.draft_cost.observe(drafter_rows, report.draft_seconds)
            if not report.drafted and self.drafter is not None and report.batch_size:
                metrics.DRAFT_SKIPPED_STEPS.inc()
        if log.isEnabledFor(logging.DEBUG):  # --log-level=DEBUG: every step, for where a step's time goes
            log.debug("step: %d requests, %d tokens, %.2f ms, drafted %s (%d drafter rows, %.2f ms, %d context rows), "
                      "verified %s accepted %s", report.batch_size, report.batch_tokens, 1e3 * report.seconds,
                      report.drafted, len(report.req_ids), 1e3 * report.draft_seconds, report.draft_context_rows,
                      list(report.verified), list(report.accepted))
        for n in report.verified:
            metrics.VERIFIED_PER_REQUEST.observe(n)
        if report.prefix_reused:
            metrics.PREFIX_REUSED_TOKENS.inc(report.prefix_reused)
        if self.source is not None:
            if self.drafter.version != self.drafter_version:  # a new checkpoint: its own calibration
                log.info("drafter version %s -> %s: temperatures reset", self.drafter_version, self.drafter.version)
                self.drafter_version, self.calibration_version = self.drafter.version, 0
                self.policy.set_temperatures(shipped_temperatures(self.drafter))
            metrics.VERIFY_BUDGET_FROM_SCHEDULER.set(int(self.source.from_scheduler))
            if self.source.from_scheduler:
                metrics.SCHEDULED_DRAFT_TOKENS.inc(sum(report.verified))
        metrics.VERIFY_BUDGET.set(self.policy.budget_in_force)
