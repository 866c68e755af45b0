"""How many draft tokens each request verifies this step, and whether to draft at all.

The speculative loop asks its policy once per step, before drafting, whether to draft
(`should_draft`: a step that would verify nothing should not pay for a draft), then, with the
drafts in hand, for per-request lengths, each within that request's draft_len. A policy sees the
drafts' confidences, never the draft tokens' target probabilities, so it cannot bias the output.

  FixedDraftLen     every request verifies up to draft_len (baseline; drafters without confidences)
  ConfidencePolicy  the two-step rule: a verify budget from a BudgetSource (dspark/sched/
                    budget_source.py), spent on the current drafts by calibrated prefix survival
"""
from __future__ import annotations

from collections import deque
from typing import Protocol

import numpy as np

from dspark.sched.calibration import LiveOffset
from dspark.sched.prefix_scheduler import admit_top_k, budget_from_survival
from dspark.sched.verify_budget import calibrated_survival


class SpeculationPolicy(Protocol):
    default_draft_len: int  # what a seeded sampled request verifies: its replay may not depend on others
    budget_in_force: int  # draft tokens the last decision let the whole batch verify (metrics, load)

    probing: bool  # the last should_draft said yes only to refresh confidences (none will be verified)

    def should_draft(self, num_requests: int) -> bool: ...

    def probe_missed(self) -> None: ...

    # sample_of: the block's (or probe's) drafter rows stand for this many of the batch (0: themselves).
    def observe_probe(self, conf_logits, sample_of: int = 0) -> None: ...

    def observe_outcomes(self, conf_logits, accepted_len, verified_len) -> None: ...

    def lengths(self, block, draft_lens: list[int], sample_of: int = 0) -> list[int]: ...

    # While drafting is skipped: whether free blocks (lookups, no drafting cost) are worth looking up at
    # this batch, and how much of one to verify.
    def free_may_pay(self, num_requests: int) -> bool: ...

    def free_lengths(self, block, draft_lens: list[int]) -> list[int]: ...

    def observe_lookup(self, seconds: float, num_requests: int) -> None: ...

    def observe_free_step(self, num_requests: int, tokens: int, seconds: float) -> None: ...


def standing_for(survival: np.ndarray, rows: int) -> np.ndarray:
    """A sample's survival rows, repeated in turn to stand for `rows` rows when that is more: a budget
    from them is then priced as drafting for the batch the sample came from."""
    return survival if rows <= len(survival) else np.resize(survival, (rows, survival.shape[1]))


class FixedDraftLen:
    probing = False

    def __init__(self, draft_len: int):
        self.default_draft_len = self.budget_in_force = max(0, int(draft_len))

    def should_draft(self, num_requests: int) -> bool:
        return self.default_draft_len > 0

    def probe_missed(self) -> None:
        pass  # never probes

    def observe_probe(self, conf_logits, sample_of: int = 0) -> None:
        pass  # never probes

    def observe_outcomes(self, conf_logits, accepted_len, verified_len) -> None:
        pass  # lengths do not depend on how drafts fared

    def lengths(self, block, draft_lens: list[int], sample_of: int = 0) -> list[int]:
        """block: the DraftBlock (unused here); draft_lens: per-request caps (override, room left)."""
        lengths = [max(0, min(self.default_draft_len, c)) for c in draft_lens]
        self.budget_in_force = sum(lengths)
        return lengths

    def free_may_pay(self, num_requests: int) -> bool:
        return False  # it skips only at draft_len 0: nothing is verified then, so nothing is looked up

    def free_lengths(self, block, draft_lens: list[int]) -> list[int]:
        return [0] * len(draft_lens)

    def observe_lookup(self, seconds: float, num_requests: int) -> None:
        pass  # never looks up free blocks

    def observe_free_step(self, num_requests: int, tokens: int, seconds: float) -> None:
        pass


PROBE_GAP_REQUESTS = 4  # a "no" stands up to 4 x probe_every steps a request of the step, up to this many
FREE_VERDICT_STEPS = 8  # steps the model's verdict on free lookups stands (free_may_pay)
FREE_ROWS_KEPT = 64  # rows of recent free blocks that stand for the guesses lookups will find
LOOKUP_COST_WEIGHT = 0.2  # EMA weight of one free lookup's seconds per request
# EMA weight of one free step in the measured gain: a ratio of two sums, tokens over time, so a step weighs
# what it took. An EMA of per-step ratios at 0.2 fell below 1 after a few rejected guesses in a row: one
# request skipped lookups on a third of its steps where they gave 1.6x plain decoding's tokens a second.
# The first steps average alike (weight 1/n), and the measure decides nothing before FREE_GAIN_MIN_STEPS of
# them: one rejected first guess stopped one request's lookups for 200 steps.
FREE_GAIN_WEIGHT = 0.05
FREE_GAIN_MIN_STEPS = 8


def batch_bucket(num_requests: int) -> int:
    """1, 2-3, 4-7, 8-15, ...: batches alike enough to share a measured gain."""
    return max(1, int(num_requests)).bit_length()


class ConfidencePolicy:
    """The top verify-budget drafts by current calibrated prefix survival, the budget from `source`.

    Budget 0 means drafting does not pay for itself (weak drafts, or a batch large enough that the
    target is compute-bound): the next steps skip the drafter entirely, plain decoding, except for
    a probe after `first_probe` skipped steps (default probe_every), whose drafts refresh the
    confidences the budget is computed from. While probes keep finding 0 the gap between them
    doubles, up to 4 x probe_every at one request and 16 x from four on, so a steady "no" costs
    little; any budget > 0 resets it, and a smaller batch shortens it to its own longest gap. A
    remote drafter answers a probe in the background (`probing`; the answer comes back through
    `observe_probe`), so a probe costs the target nothing, and the verifier probes from the first
    skipped step on (first_probe = 1): one weak block would otherwise stop drafting for 16 steps.
    The decision uses older confidences only, so skipping cannot bias the output. Survivals are
    shifted by a live logit offset fitted on the outcomes of this engine's recent drafts, verified
    or checked afterwards (`observe_outcomes`, dspark/sched/calibration.py).
    """

    def __init__(self, source, temperatures=None, explore: float = 0.0, seed: int = 0, probe_every: int = 16,
                 first_probe: int | None = None, free_sps=None):
        """source: TwoStepBudget or ScheduledBudget; temperatures: STS per block position (None: T = 1);
        explore: share of requests that verify their whole draft_len anyway, so low-confidence
        tails keep getting labels for calibration; free_sps: the target's steps/s by batch tokens,
        for free blocks (default: the source's own table, if it has one)."""
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.source, self.explore, self.probe_every = source, explore, probe_every
        self.temperatures = None if temperatures is None else np.asarray(temperatures, dtype=np.float64)
        self.rng = np.random.default_rng(seed)
        self.skipped = 0  # steps skipped since the last draft
        self.first_probe = probe_every if first_probe is None else max(1, first_probe)
        self.probe_interval = self.first_probe  # skipped steps before the next probe
        self._interval_before_probe = self.first_probe
        self.budget_in_force = source.default_draft_len
        self.probing = False
        self.offset = LiveOffset()
        self.free_sps = free_sps if free_sps is not None else getattr(source, "sps", None)
        # What a free block must promise over plain decoding, as the drafter's budget must (under
        # the services the scheduler's --min-draft-gain; 1 = any gain).
        self.free_min_gain = 1.0
        self._free_rows: deque = deque(maxlen=FREE_ROWS_KEPT)  # [gamma] survivals of recent free blocks' rows
        self._free_ranked: np.ndarray | None = None  # those rows, best first (None: rank them when asked)
        self._free_verdict: tuple[int, bool] | None = None  # (requests, whether guesses like those pay)
        self._free_verdict_age = 0  # steps it has stood
        self._free_unlooked = 0  # steps since free blocks were last looked up
        self.lookup_seconds = 0.0  # a free lookup's seconds per request (EMA)
        # batch bucket -> (free steps seen, EMA of tokens x plain seconds, EMA of requests x seconds)
        self._free_sums: dict[int, tuple[int, float, float]] = {}

    @property
    def free_gain(self) -> dict[int, float]:
        """batch bucket -> free steps' tokens a second over plain decoding's, as measured."""
        return {bucket: made / took for bucket, (_, made, took) in self._free_sums.items()}

    @property
    def default_draft_len(self) -> int:
        return self.source.default_draft_len

    def set_temperatures(self, temperatures) -> None:
        self.temperatures = None if temperatures is None else np.asarray(temperatures, dtype=np.float64)

    def should_draft(self, num_requests: int) -> bool:
        self.source.tick()
        self.probing = False
        if self.probe_every == 1 or self.source.next_budget(num_requests) > 0:
            self.skipped, self.probe_interval = 0, self.first_probe
            return True
        self.skipped += 1
        self.budget_in_force = 0
        # A probe drafts for up to four requests and first takes in every position they missed. The more
        # requests, the less drafting can pay, so the longer a "no" stands; a smaller batch waits no longer
        # than its own longest gap. (8 requests, drafter inside the verifier: probing after 16-64 skipped
        # steps cost 4% of plain decoding's tokens/s, probes almost never none; docs/results.md, session 41.)
        longest = 4 * self.probe_every * min(max(num_requests, 1), PROBE_GAP_REQUESTS)
        self.probe_interval = min(self.probe_interval, longest)
        if self.skipped < self.probe_interval:
            return False
        self.skipped = 0  # a probe; should it find 0 again, the next one waits longer
        self._interval_before_probe = self.probe_interval
        self.probe_interval = min(2 * self.probe_interval, longest)
        self.probing = True
        return True

    def probe_missed(self) -> None:
        """The probe drafted no row of the drafter's own: prompt lookup guessed for every request, so the
        drafter was not asked and no confidences came of it (one request, lookup guessing on two steps
        in three: the budget stayed 0 for 300-400 steps between useful probes). The next skipped step
        probes again, and the gap after it is what it would have been."""
        if self.probing:
            self.probing = False
            self.probe_interval = self._interval_before_probe
            self.skipped = self.probe_interval - 1

    def observe_probe(self, conf_logits, sample_of: int = 0) -> None:
        """Confidences of a probe answered in the background: the newest the budget can use."""
        self.source.observe(standing_for(calibrated_survival(conf_logits, self.temperatures, self.offset.value),
                                         sample_of))

    def observe_outcomes(self, conf_logits, accepted_len, verified_len) -> None:
        if hasattr(conf_logits, "cpu"):
            conf_logits = conf_logits.float().cpu().numpy()
        self.offset.observe(conf_logits, self.temperatures, accepted_len, verified_len)

    def _survival(self, block) -> np.ndarray:
        """Prefix survivals of a block: the drafter's rows through STS and the live offset, rows
        calibrated already (prompt lookup) as they are."""
        calibrated = getattr(block, "calibrated", None)  # a DraftBlock's; absent on a bare confidences holder
        if calibrated is not None and bool(calibrated.all()):
            return calibrated_survival(block.conf_logits)
        survival = calibrated_survival(block.conf_logits, self.temperatures, self.offset.value)
        if calibrated is not None and bool(calibrated.any()):
            survival[calibrated.cpu().numpy()] = calibrated_survival(block.conf_logits[calibrated])
        return survival

    def free_may_pay(self, num_requests: int) -> bool:
        """Whether to look up free blocks this step: whether verifying guesses like the recent ones would
        pay at this batch, lookups' own time included. Lookups cost ~0.07 ms a request (2 ms a step at
        32 requests, ~8% of it) even when nothing is verified. The recent free blocks' rows, sorted
        by promise, are sampled at evenly spaced ranks from the best down, one per request: a batch
        holds about as many good guesses as recent ones did (one request: the best). Where it would
        not pay, lookups are skipped, but for a look every probe_every steps that refreshes the
        rows. Decides nothing about the output: a block not looked up is a block not verified."""
        if self.free_sps is None:
            return False
        if not self._free_rows or self._free_unlooked >= self.probe_every:
            self._free_unlooked = 0
            return True
        # What free steps at batches like this one really gave, over what plain steps give: the model's
        # step times run short where the table is jagged or only profiled (32 requests: verifying 19
        # guesses a step took 36 ms where plain steps took 22, 13% fewer tokens a second, while the
        # table promised a gain). Below 1 no lookup pays, whatever the model says, but for the looks.
        steps, made, took = self._free_sums.get(batch_bucket(num_requests), (0, 0.0, 0.0))
        pays = steps < FREE_GAIN_MIN_STEPS or made >= took
        if pays:
            pays = self._free_model_pays(num_requests)
        self._free_unlooked = 0 if pays else self._free_unlooked + 1
        return pays

    def _free_model_pays(self, num_requests: int) -> bool:
        """The step-time model's verdict on guesses like the recent ones at this batch, kept for
        FREE_VERDICT_STEPS steps of the same batch size: the recent rows and the tables move slowly, and
        ranking and weighing them took ~0.4 ms a step (5% of a one-request step)."""
        verdict, self._free_verdict_age = self._free_verdict, self._free_verdict_age + 1
        if verdict is not None and verdict[0] == num_requests and self._free_verdict_age < FREE_VERDICT_STEPS:
            return verdict[1]
        if self._free_ranked is None:
            pool = np.stack(self._free_rows)
            self._free_ranked = pool[np.argsort(-pool.sum(axis=1), kind="stable")]
        ranked = self._free_ranked
        rows = ranked[np.linspace(0, len(ranked) - 1, num_requests).round().astype(np.int64)]
        try:
            pays = budget_from_survival(rows, self.free_sps, self.lookup_seconds * num_requests,
                                        min_gain=self.free_min_gain) > 0
        except ValueError:  # no step time measured yet: free_lengths would verify nothing
            pays = False
        self._free_verdict, self._free_verdict_age = (num_requests, pays), 0
        return pays

    def observe_lookup(self, seconds: float, num_requests: int) -> None:
        """The time one free lookup over num_requests requests took."""
        per_request = seconds / max(1, num_requests)
        self.lookup_seconds = per_request if not self.lookup_seconds else \
            self.lookup_seconds + LOOKUP_COST_WEIGHT * (per_request - self.lookup_seconds)

    def observe_free_step(self, num_requests: int, tokens: int, seconds: float) -> None:
        """A step that verified free blocks: `tokens` came out in `seconds` (lookups included), against
        num_requests tokens in the time a plain step of this batch takes (the table's, which every plain
        step keeps current)."""
        if self.free_sps is None or seconds <= 0 or num_requests < 1:
            return
        try:
            plain_seconds = 1.0 / float(self.free_sps(num_requests))
        except ValueError:
            return
        bucket = batch_bucket(num_requests)
        made, took = tokens * plain_seconds, num_requests * seconds  # tokens as plain steps' time, and the time
        steps, old_made, old_took = self._free_sums.get(bucket, (0, 0.0, 0.0))
        weight = max(FREE_GAIN_WEIGHT, 1.0 / (steps + 1))
        made, took = old_made + weight * (made - old_made), old_took + weight * (took - old_took)
        self._free_sums[bucket] = steps + 1, made, took

    def free_lengths(self, block, draft_lens: list[int]) -> list[int]:
        """The two-step rule's trade-off on this block itself, with no drafting cost: it is already
        made, and deterministic (prompt lookup), so its confidences cannot bias the output."""
        if self.free_sps is None or block.conf_logits is None:
            return [0] * len(draft_lens)
        survival = self._survival(block)
        self._free_rows.extend(survival)
        self._free_ranked = None
        return [int(x) for x in self._lookup_lengths(survival, np.asarray(draft_lens))]

    def _lookup_lengths(self, survival: np.ndarray, caps: np.ndarray, base_tokens: int = 0) -> np.ndarray:
        """Lengths for lookup rows (prompt lookup, the datastore): the budget that pays best for these
        survivals at this step's cost (free_sps; one row per request of the batch, rows lookup has no
        guess for at survival 0, and base_tokens verified anyway), the best drafts first; none before
        a step time is measured (a live SPS table fills from steps)."""
        try:
            budget = budget_from_survival(survival, self.free_sps, min_gain=self.free_min_gain,
                                          base_tokens=base_tokens)
        except ValueError:
            return np.zeros(len(caps), dtype=np.int64)
        return admit_top_k(survival, budget, caps)

    def lengths(self, block, draft_lens: list[int], sample_of: int = 0) -> list[int]:
        if block is None or block.conf_logits is None:  # no confidences: a fixed length
            lengths = [min(self.default_draft_len, c) for c in draft_lens]
            self.budget_in_force = self.default_draft_len * len(draft_lens)
            self.source.from_scheduler = False
            return lengths
        survival = self._survival(block)
        self.budget_in_force = self.source.budget(len(draft_lens))
        caps = np.asarray(draft_lens)
        # The budget is the drafter's, from the drafter's confidences: it would cap lookup's guesses at a
        # few tokens where a loop that prompt lookup follows keeps all seven (services, one request: 1.95
        # tokens a pass, 2.35 at a fixed 7). Lookup's rows get their own trade-off, as in a free step,
        # against the cost of the whole step: every request's row and the drafter's admitted tokens.
        calibrated = getattr(block, "calibrated", None)
        lookup = np.zeros(len(caps), dtype=bool) if calibrated is None or self.free_sps is None else \
            calibrated.cpu().numpy()
        lengths = np.zeros(len(caps), dtype=np.int64)
        drafter = ~lookup
        if drafter.any():
            self.source.observe(standing_for(survival[drafter], sample_of))
            lengths[drafter] = admit_top_k(survival[drafter], self.budget_in_force, caps[drafter])
        if lookup.any():
            lookup_only = np.where(lookup[:, None], survival, 0.0)
            lengths[lookup] = self._lookup_lengths(lookup_only, caps, int(lengths[drafter].sum()))[lookup]
        if self.explore > 0:
            # Chosen independently of the drafts, so exploring cannot bias the output.
            full = self.rng.random(len(draft_lens)) < self.explore
            lengths = np.where(full, np.asarray(draft_lens), lengths)
        return [int(x) for x in lengths]
