"""Capacity K per verifier by the two-step rule (DESIGN.md 1.4), off the verifiers' critical path.

A verifier's step reports carry the raw confidence logits of its whole batch. For each verifier
we keep the newest report's (by step number; replies may be processed out of order) and, when
it comes, compute K = capacity_from_confidences(calibrated prefix survivals, SPS table) with the
verifier's own published SPS and draft-cost tables and the newest temperatures of its drafter
version (K = 0 tells the verifier to skip drafting: the drafts would not pay for it). The
verifier receives K with the reply, and uses it from its next step on: by then the confidences
behind K are at least a step old (two steps with the reply in flight), never the drafts K
admits, which keeps the output exactly the target's.
"""
from __future__ import annotations

import numpy as np

from dspark.sched.calibration import apply_sts, sigmoid
from dspark.sched.prefix_scheduler import capacity_from_confidences, prefix_survival
from dspark.sched.sps import SpsTable
from dspark.serving import metrics


def sps_table(points) -> SpsTable | None:
    """From VerifierLoad.sps points or the registry's [[B, steps/s], ...]; None when empty."""
    pairs = [(int(b), float(s)) for b, s in points if int(b) >= 1 and float(s) > 0]
    return SpsTable.from_sps(dict(pairs)) if pairs else None


def draft_cost_table(points) -> SpsTable | None:
    """From VerifierLoad.draft_cost or the registry's [[R, seconds], ...]; None when empty."""
    pairs = [(int(r), float(s)) for r, s in points if int(r) >= 1 and float(s) > 0]
    return SpsTable(dict(pairs)) if pairs else None


def capacity_for(conf_logits: np.ndarray, temperatures, sps, draft_cost: SpsTable | None = None) -> int:
    """K from raw logits [R, gamma]: calibrated (T = 1 without temperatures) prefix survivals;
    draft_cost: seconds drafting adds by R (None: not measured yet, taken as free)."""
    conf = sigmoid(conf_logits) if temperatures is None else apply_sts(conf_logits, temperatures)
    draft_seconds = draft_cost.seconds(conf_logits.shape[0]) if draft_cost is not None else 0.0
    return capacity_from_confidences(prefix_survival(conf), sps, draft_seconds)


class CapacityPlanner:
    def __init__(self):
        self._newest: dict[str, int] = {}  # verifier id -> step of the confidences behind its K
        self.k: dict[str, int] = {}

    def on_report(self, verifier_id: str, step: int, conf_logits: np.ndarray, temperatures, sps_points,
                  draft_cost_points=()) -> int | None:
        """Recompute K from a report that is newer than the last one used; returns K in force."""
        if step <= self._newest.get(verifier_id, -1) or conf_logits.shape[0] == 0:
            return self.k.get(verifier_id)
        sps = sps_table(sps_points)
        if sps is None:
            return self.k.get(verifier_id)
        self._newest[verifier_id] = step
        k = self.k[verifier_id] = capacity_for(conf_logits, temperatures, sps, draft_cost_table(draft_cost_points))
        metrics.SCHEDULED_K.labels(verifier_id).set(k)
        return k

    def forget(self, verifier_id: str) -> None:
        """A verifier (re)registered: its step numbers start again."""
        self._newest.pop(verifier_id, None)
        self.k.pop(verifier_id, None)
