"""How many draft tokens one verification step takes: the two-step rule as plain functions.

Two quantities, kept apart by name everywhere:
  draft_len      a request's own cap on the draft tokens it verifies per step (its
                 SpeculationOverride, the drafter's block size, the room it has left);
  verify_budget  a step's total of draft tokens over the whole batch, chosen from confidences
                 at least a step old (docs/method.md, "The two-step rule").

`verify_budget` is what the scheduler service computes off the verifier's critical path and
what the in-process policy computes for itself; the policy then spends it on the current drafts
(`admit_top_k`), best calibrated prefix survival first, within each request's draft_len. A budget never
sees the drafts it admits and a token never outranks its own prefix: the output stays exactly
the target's.
"""
from __future__ import annotations

import numpy as np

from dspark.sched.calibration import apply_sts, sigmoid
from dspark.sched.prefix_scheduler import budget_from_survival, prefix_survival

# A budget averages the survivals of a verifier's newest POOLED_REPORTS step reports, more while they
# hold fewer than POOLED_BLOCKS drafted blocks (scheduler_svc.budget_planner; the verifier's reporter
# waits for as many blocks before a call).
POOLED_REPORTS = 4
POOLED_BLOCKS = 16


def calibrated_survival(conf_logits, temperatures=None, offset: float = 0.0) -> np.ndarray:
    """Prefix survivals [R, gamma] from raw confidence logits, through STS temperatures
    (T = 1 without them) and a logit offset (LiveOffset). A tensor, maybe on a GPU, comes to
    the host in one copy."""
    if hasattr(conf_logits, "cpu"):
        conf_logits = conf_logits.float().cpu().numpy()
    z = np.asarray(conf_logits, dtype=np.float64)
    return prefix_survival(sigmoid(z + offset) if temperatures is None else apply_sts(z, temperatures, offset))


def verify_budget(conf_logits, temperatures, sps, draft_seconds: float = 0.0) -> int:
    """The step's budget from confidences of an earlier step. sps: callable B -> target steps
    per second (an SpsTable); draft_seconds: what drafting adds to a step for these requests
    (0 = free). 0 means drafting does not pay: plain decoding."""
    return budget_from_survival(calibrated_survival(conf_logits, temperatures), sps, draft_seconds)


def pooled_survival(recent: list[np.ndarray], rows: int) -> np.ndarray:
    """[rows, gamma]: the mean survival row of the blocks of the last few reports, for each of this
    step's requests. One block's confidences say little about the next step's block (AUROC 0.77
    at position 1 for the shipped drafter): at one request, budgets from single blocks flipped
    between 7 and 0 from step to step, and each flip back cost a draft after a skipped step."""
    return np.concatenate(recent).mean(axis=0, keepdims=True).repeat(rows, axis=0)
