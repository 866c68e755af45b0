"""The verify budget per verifier by the two-step rule (dspark/sched/verify_budget.py), computed
off the verifiers' critical path.

A verifier's step reports carry the raw confidence logits of its whole batch. For each verifier
we keep the survivals of its newest reports (by step number; replies may be processed out of
order): calibrated by the newest temperatures of its drafter version and shifted by the
verifier's live logit offset (dspark/sched/calibration.py LiveOffset: fitted on the outcomes its
own recent steps decided, so the promise follows the prompts it serves now). The budget comes
from the mean survival row of the last POOLED_REPORTS reports (more while they hold fewer than
POOLED_BLOCKS blocks) for each running request, with the
verifier's own published SPS and draft-cost tables (seconds, as it measured them); 0 tells the
verifier to skip drafting: the drafts would not pay for it. The verifier receives the budget with
the reply and uses it from its next step on: by then the confidences behind it are at least a
step old (two steps with the reply in flight), never the drafts it admits, which keeps the output
exactly the target's.
"""
from __future__ import annotations

import logging
from collections import deque

import numpy as np

from dspark.sched.calibration import LiveOffset
from dspark.sched.prefix_scheduler import budget_from_survival
from dspark.sched.sps import SpsTable
from dspark.sched.verify_budget import POOLED_BLOCKS, POOLED_REPORTS, calibrated_survival, pooled_survival
from dspark.serving import metrics

log = logging.getLogger(__name__)
STEP_RATIO_WEIGHT = 0.2  # EMA weight of one step's real / modelled time


def seconds_table(points) -> SpsTable | None:
    """From [[count, seconds], ...] (VerifierLoad.sps by batch tokens, .draft_cost by requests);
    None when empty."""
    pairs = [(int(n), float(s)) for n, s in points if int(n) >= 1 and float(s) > 0]
    return SpsTable(dict(pairs)) if pairs else None


class BudgetPlanner:
    def __init__(self, min_gain: float = 1.0, pooled_reports: int = POOLED_REPORTS, pooled_blocks: int = POOLED_BLOCKS):
        """min_gain: drafting must promise this many times plain decoding's throughput (see
        scheduler_svc.__main__ --min-draft-gain); a verifier's budget's survivals are averaged over its
        newest pooled_reports reports, and over more while those hold fewer than pooled_blocks blocks:
        one request's report is one block, and four of them made its budget flip between drafting and
        not from step to step. (Services, one request, 16 blocks against 4 in the same runs: +3.6%,
        +1.9%, +2.4%, -2.4% tokens/s, inside the host's spread; docs/results.md, session 32.)"""
        self.min_gain, self.pooled_reports, self.pooled_blocks = min_gain, pooled_reports, pooled_blocks
        self._newest: dict[str, int] = {}  # verifier id -> step of the confidences behind its budget
        self.budgets: dict[str, int] = {}
        self.offsets: dict[str, LiveOffset] = {}
        self._recent: dict[str, deque] = {}  # verifier id -> survivals of its newest reports
        self.drafted_ratio: dict[str, float] = {}  # verifier id -> real / modelled seconds of drafted steps

    def learn(self, verifier_id: str, conf_logits: np.ndarray, temperatures, accepted_len, verified_len) -> float:
        """Outcomes this verifier decided (verified drafts, or unverified ones checked since): its offset."""
        offset = self.offsets.setdefault(verifier_id, LiveOffset())
        offset.observe(conf_logits, temperatures, accepted_len, verified_len)
        metrics.LIVE_CONFIDENCE_OFFSET.labels(verifier_id).set(offset.value)
        return offset.value

    def observe_step(self, verifier_id: str, drafted_rows: int, batch_tokens: int, seconds: float, drafted: bool,
                     sps_points, draft_cost_points=()) -> None:
        """A drafted step as it really ran against what the published tables say it costs: the target
        pass at B tokens plus the draft. The tables hold plain steps well (every plain step updates
        B = R), but a drafted step lands on a sparse bucket between warm-up points and costs more than
        its parts on a shared host (the drafter takes in the pushed context beside the pass): fixed
        k = 7 at 4 requests took 95 ms a step where the tables said 50. Plain steps are not used:
        only those that carry a probe's answer are reported, and the probe ran beside them. Nor are the
        steps where the drafter resumed (StepReport.draft_resumed): the draft-cost table leaves them out,
        and counted here they made drafted steps look 1.3-1.4x dearer than the tables at one request,
        whose drafted steps follow runs of skipped ones, so the budget was 0 for most of the time
        (docs/results.md, session 42). drafted_rows: the requests the drafter drafted
        for (the draft-cost table's key; lookup's rows skip it); drafted: a drafted step to weigh."""
        sps, draft_cost = seconds_table(sps_points), seconds_table(draft_cost_points)
        if not drafted or sps is None or draft_cost is None or seconds <= 0 or drafted_rows < 1:
            return
        modelled = sps.seconds(batch_tokens) + draft_cost.seconds(drafted_rows)
        ratio = float(np.clip(seconds / modelled, 0.25, 4.0))
        old = self.drafted_ratio.get(verifier_id, 1.0)
        self.drafted_ratio[verifier_id] = old + STEP_RATIO_WEIGHT * (ratio - old)

    def drafted_scale(self, verifier_id: str) -> float:
        """Real / modelled seconds of this verifier's recent drafted steps (1 before any)."""
        return self.drafted_ratio.get(verifier_id, 1.0)

    def on_report(self, verifier_id: str, step: int, conf_logits: np.ndarray, temperatures, sps_points,
                  draft_cost_points=(), requests: int = 0, sample_of: int = 0) -> int | None:
        """One report: on_reports with it alone."""
        return self.on_reports(verifier_id, [(step, conf_logits)], temperatures, sps_points, draft_cost_points,
                               requests, sample_of)

    def on_reports(self, verifier_id: str, reports, temperatures, sps_points, draft_cost_points=(),
                   requests: int = 0, sample_of: int = 0) -> int | None:
        """Reports [(step, conf_logits)] oldest first, as one ReportSteps call brings them: those newer
        than the last one used join the pool, then the budget is computed once, for the newest report's
        step: its rows are the drafter's, of `requests` in the step (its batch size; 0: the rows alone),
        or a probe's sample of them that stands for `sample_of` drafter rows (0: for themselves), and the
        draft is priced at that many; returns the budget in force."""
        offset = self.offsets.setdefault(verifier_id, LiveOffset())
        newest = self._newest.get(verifier_id, -1)
        reports = [(step, conf) for step, conf in reports if step > newest and conf.shape[0] > 0]
        sps = seconds_table(sps_points)
        if not reports or sps is None:
            return self.budgets.get(verifier_id)
        recent = self._recent.setdefault(verifier_id, deque())
        for _, conf in reports:
            recent.append(calibrated_survival(conf, temperatures, offset.value))
        blocks = sum(len(survival) for survival in recent)
        while len(recent) > self.pooled_reports and blocks - len(recent[0]) >= self.pooled_blocks:
            blocks -= len(recent.popleft())
        step, conf_logits = reports[-1]
        self._newest[verifier_id] = step
        rows = max(conf_logits.shape[0], int(sample_of))
        draft_cost = seconds_table(draft_cost_points)
        draft_seconds = draft_cost.seconds(rows) if draft_cost is not None else 0.0
        pooled = pooled_survival(list(recent), rows)
        scale = self.drafted_scale(verifier_id)
        requests = max(requests, rows)
        budget = self.budgets[verifier_id] = budget_from_survival(pooled, sps, draft_seconds, scale, self.min_gain,
                                                                  requests=requests)
        log.debug("verifier %s step %d: %d requests, %d drafted, offset %.2f, promised %.2f draft tokens, draft %.1f "
                  "ms, plain step %.1f ms, drafted steps x%.2f -> budget %d", verifier_id, step, requests,
                  rows, offset.value, float(pooled.sum()), 1e3 * draft_seconds,
                  1e3 * sps.seconds(requests), scale, budget)
        metrics.SCHEDULED_VERIFY_BUDGET.labels(verifier_id).set(budget)
        return budget

    def forget(self, verifier_id: str) -> None:
        """A verifier (re)registered: its step numbers start again."""
        self._newest.pop(verifier_id, None)
        self.budgets.pop(verifier_id, None)
        self.offsets.pop(verifier_id, None)
        self._recent.pop(verifier_id, None)
        self.drafted_ratio.pop(verifier_id, None)
