"""Prompt lookup in front of a drafter: the n-gram index, its confidences, and that the target's
output is unchanged (greedy identical, sampled in distribution, seeded requests replay)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.drafters.lookup import NO_GUESS, LookupDrafter, LookupStats
from dspark.drafters.ngram_index import NgramIndex
from dspark.sampling import SamplingParams
from dspark.speculative.engine import SpecEngine
from dspark.speculative.policy import FixedDraftLen
from tests.spec_helpers import greedy_reference, random_drafter, tiny_target
from tests.test_spec_decoding import _first_tokens, homogeneity, prompts_of


def index_of(tokens, min_n=2, max_n=4):
    index = NgramIndex(min_n, max_n)
    index.append(tokens)
    return index


def test_continuation_follows_the_longest_earlier_match():
    # suffix (1, 2, 3) ended at position 2 before: what followed it is 4, 5, 1
    assert index_of([1, 2, 3, 4, 5, 1, 2]).continuation(3, 3) == ([4, 5, 1], 3)
    # (9, 2) never occurred, nor (2,) is long enough with min_n = 2
    assert index_of([1, 2, 3, 4, 5, 9]).continuation(2, 3) == ([], 0)


def test_continuation_prefers_the_latest_occurrence_and_the_longest_n():
    # (5, 6) ended at 1 (then 7) and at 5 (then 8): the latest wins
    assert index_of([5, 6, 7, 1, 5, 6, 8, 2, 5]).continuation(6, 1) == ([8], 2)
    # (1, 5, 6) is longer than (5, 6) and ended at 2 (then 9), though (5, 6) recurs later (then 8)
    assert index_of([1, 5, 6, 9, 0, 5, 6, 8, 1, 5]).continuation(6, 1) == ([9], 3)


def test_continuation_follows_a_loop_round():
    # only four tokens of history, yet a guess of five: the loop is re-matched as it grows
    assert index_of([7, 8, 7, 8]).continuation(7, 5) == ([8, 7, 8, 7, 8], 3)


def test_truncate_forgets_ngrams_past_the_new_length():
    index = index_of([1, 2, 3, 4, 1, 2])
    index.truncate(3)
    assert index.tokens == [1, 2, 3]
    assert index.continuation(4, 2) == ([], 0)  # (3, 4) is gone with the truncated tokens
    assert index.continuation(1, 2) == ([], 0)
    index.append([1])
    assert index.continuation(2, 2) == ([3, 1], 2)


def test_stats_count_conditional_outcomes_per_match_length():
    stats = LookupStats(max_n=4, gamma=3)
    stats.record(2, [5, 6, 7], [5, 9, 7])  # 1st confirmed, 2nd not: the 3rd is not counted
    stats.record(2, [5, 6, 7], [5])  # only the 1st decided so far
    assert stats.hits[2] == [2, 0, 0] and stats.tries[2] == [2, 1, 0]
    logits = stats.logits(2, length=2)
    assert logits[0] > 0 > logits[1]  # 3/4 vs 1/3 with the Beta(1, 1) prior
    assert logits[2] == NO_GUESS  # past the guess


def repetitive_prompts(count, vocab=64):
    """Prompts that repeat a phrase, so lookup has something to find from the first step on."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(3, vocab, (4 + i % 3,), generator=g).tolist() * 3)[: 9 + i] for i in range(count)]


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
@pytest.mark.parametrize("concurrent", [1, 8])
def test_greedy_identical_with_lookup(kind, concurrent):
    target = tiny_target()
    prompts = repetitive_prompts(concurrent) if concurrent > 1 else prompts_of([12])
    max_tokens = [40, 25, 33, 18, 40, 29, 11, 37][:concurrent]
    drafter = LookupDrafter(random_drafter(target, kind))
    engine = SpecEngine(target, drafter, FixedDraftLen(4), max_batch=8, max_len=256)
    seqs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    for seq, m, p in zip(seqs, max_tokens, prompts):
        assert seq.output == greedy_reference(target, [p], m)[0]
    assert sum(map(sum, drafter.stats.tries)) > 0  # lookup drafted ...
    assert sum(map(sum, drafter.stats.hits)) > 0  # ... and some of it was right


def test_lookup_blocks_carry_point_masses_and_earned_confidences():
    target = tiny_target()
    drafter = LookupDrafter(random_drafter(target, "dspark", gamma=4))
    features = torch.zeros(6, len(drafter.ctx_layers) * target.config.hidden_size)
    drafter.extend_context("a", features, torch.tensor([3, 4, 5, 6, 3, 4]))
    drafter.extend_context("b", features, torch.tensor([10, 11, 12, 13, 14, 15]))
    block = drafter.draft(["a", "b"], torch.tensor([5, 16]), torch.zeros(2), [None, None])
    assert block.tokens[0].tolist() == [6, 3, 4, 5]  # (4, 5) -> 6, 3, 4, then the loop goes round
    assert block.support_ids[0, :, 0].tolist() == [6, 3, 4, 5]
    assert block.support_probs[0, :, 0].tolist() == [1.0] * 4 and block.support_probs[0, :, 1:].sum() == 0
    assert block.conf_logits[0].tolist() == [0.0] * 4  # nothing earned yet: p = 1/2
    assert block.support_probs[1].sum(-1).allclose(torch.ones(4))  # b: the drafter's own block
    # The target decides 6, 3, 9: lookup's first two guesses were right, the third wrong.
    drafter.extend_context("a", features[:3], torch.tensor([5, 6, 3]))
    drafter.draft(["a"], torch.tensor([9]), torch.zeros(1), [None])
    assert drafter.stats.hits[3][:3] == [1, 1, 0] and drafter.stats.tries[3][:3] == [1, 1, 1]


def law_target():
    """The tiny target of the sampled-law tests: vocab 8, so 20,000 samples cover the joint law."""
    return tiny_target(vocab=8, seed=5, layers=2, sharpness=3.0)


def assert_first_tokens_keep_the_targets_law(target, drafter, prompt, stats):
    """Chi-square homogeneity of the first tokens, 20,000 seeded requests with `drafter` (k = 3) and
    as many plainly sampled; `stats` (a LookupStats) must show that the lookup under test drafted."""
    from dspark.engine.generate import Engine

    n, params = 20_000, dict(temperature=1.0)
    plain = _first_tokens(lambda: Engine(target, max_batch=2000, max_len=24), prompt, params, n)
    spec = _first_tokens(lambda: SpecEngine(target, drafter, FixedDraftLen(3), max_batch=2000, max_len=24),
                         prompt, params, n)
    assert sum(map(sum, stats.tries)) > 0
    p_value, common, table = homogeneity(plain, spec, n)
    assert len(common) >= 10
    assert p_value > 0.001, (p_value, table)


def test_sampled_first_tokens_match_plain_sampling_with_lookup():
    """As for the drafter alone: point-mass drafts keep the target's law."""
    target = law_target()
    drafter = LookupDrafter(random_drafter(target, "dspark", gamma=3, seed=6, support_size=4))
    # the suffix (1, 2) recurs: lookup drafts the first block
    assert_first_tokens_keep_the_targets_law(target, drafter, [1, 2, 3, 1, 2, 3, 1, 2], drafter.stats)


def assert_seeded_replay(target, make_drafter, prompts):
    """A seeded sampled request (the first prompt) gives the same tokens alone, again, and beside the
    others, each run with a fresh drafter from make_drafter()."""
    def run(batch):
        engine = SpecEngine(target, make_drafter(), FixedDraftLen(4), max_batch=8, max_len=256)
        seqs = engine.generate(batch, [SamplingParams(max_tokens=30, temperature=0.9, seed=7)] * len(batch))
        return seqs[0].output

    alone = run(prompts[:1])
    assert run(prompts[:1]) == alone
    assert run(prompts) == alone


def test_seeded_requests_replay_with_lookup_whatever_runs_beside_them():
    target = tiny_target(sharpness=3.0)
    assert_seeded_replay(target, lambda: LookupDrafter(random_drafter(target, "dspark", support_size=4)),
                         repetitive_prompts(4))


def test_held_back_rows_reach_the_drafter_before_it_drafts_and_rollbacks_see_them():
    target = tiny_target()
    inner = random_drafter(target, "dspark", gamma=4)
    drafter = LookupDrafter(inner)
    width = len(drafter.ctx_layers) * target.config.hidden_size
    rows = torch.randn(8, width)
    drafter.extend_context("a", rows[:5], torch.tensor([3, 4, 5, 6, 7]))
    assert drafter.context_len("a") == 5 and inner.context_len("a") == 0  # held here while lookup is asked first
    drafter.rollback("a", 5)  # what the drafter service does before every draft: a no-op
    drafter.rollback("a", 3)
    assert drafter.context_len("a") == 3
    drafter.extend_context("a", rows[3:4], torch.tensor([9]))
    drafter.draft(["a"], torch.tensor([11]), torch.zeros(1), [None])  # no match: the drafter drafts
    assert inner.context_len("a") == 4
    # The inner drafter saw exactly the rows of positions 0..3, as if it had been extended directly.
    direct = random_drafter(target, "dspark", gamma=4)
    direct.extend_context("a", torch.cat([rows[:3], rows[3:4]]), torch.tensor([3, 4, 5, 9]))
    a = inner.draft(["a"], torch.tensor([11]), torch.zeros(1), [None])
    b = direct.draft(["a"], torch.tensor([11]), torch.zeros(1), [None])
    assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.conf_logits, b.conf_logits)
    drafter.rollback("a", 2)  # below what the drafter holds: its own rollback
    assert drafter.context_len("a") == inner.context_len("a") == 2


def test_while_the_drafter_is_skipped_lookup_blocks_are_verified_where_they_pay():
    """The drafter's budget stays 0 (default_draft_len 0, probes far apart): it is never asked, but
    lookup blocks cost nothing to make, so they are verified as far as the target's step times say
    they pay (a flat table: every guess worth a look); the text is the target's."""
    from dspark.sched.budget_source import TwoStepBudget
    from dspark.speculative.policy import ConfidencePolicy

    target = tiny_target()
    prompts = repetitive_prompts(3)
    drafter = LookupDrafter(random_drafter(target, "dspark"))
    calls = []
    drafter.inner.draft = lambda *a, **k: calls.append(a)  # the drafter itself must not be asked
    policy = ConfidencePolicy(TwoStepBudget(lambda b: 100.0, default_draft_len=0), probe_every=1000)
    engine = SpecEngine(target, drafter, policy, max_batch=4, max_len=256)
    seqs = [engine.add(p, SamplingParams(max_tokens=30)) for p in prompts]
    while engine.has_work():
        engine.step()
        report = engine.last_report
        assert not report.drafted and not report.req_ids  # neither drafting nor the drafter's report
    assert [s.output for s in seqs] == greedy_reference(target, prompts, 30)
    assert sum(s.spec.metrics.draft_tokens for s in seqs) > 0 and sum(s.spec.metrics.accepted_tokens for s in seqs) > 0
    assert not calls
    assert policy.free_gain and min(policy.free_gain.values()) > 1  # the free steps measured against plain ones
    # Steep step times (each verified token doubles a step): no guess is worth verifying.
    steep = ConfidencePolicy(TwoStepBudget(lambda b: 100.0 / 2.0 ** (b - 1), default_draft_len=0), probe_every=1000)
    engine = SpecEngine(target, LookupDrafter(random_drafter(target, "dspark")), steep, max_batch=4, max_len=256)
    seqs = [engine.add(p, SamplingParams(max_tokens=30)) for p in prompts]
    while engine.has_work():
        engine.step()
    assert [s.output for s in seqs] == greedy_reference(target, prompts, 30)
    assert sum(s.spec.metrics.draft_tokens for s in seqs) == 0


def test_free_draft_is_none_without_a_match_or_without_confidences():
    target = tiny_target()
    width = 2 * target.config.hidden_size
    for kind, expect_block in (("dspark", True), ("dflash", False)):
        drafter = LookupDrafter(random_drafter(target, kind))
        drafter.extend_context("a", torch.zeros(2, width), torch.tensor([3, 4]))
        assert drafter.free_draft(["b"], [[5, 6, 7, 8, 9]]) is None
        # Tokens alone: a's text goes on past its drafter context, which stays as it was.
        block = drafter.free_draft(["a", "b"], [[3, 4, 3, 4, 3], [5, 6, 7, 8, 9]])
        assert (block is not None) == expect_block and drafter.context_len("a") == 2
        if block is not None:
            assert block.tokens[0, :2].tolist() == [4, 3] and block.conf_logits[1].eq(NO_GUESS).all()
        # The same positions arriving as context later are not indexed twice.
        drafter.extend_context("a", torch.zeros(2, width), torch.tensor([3, 4]))
        assert drafter._texts["a"].tokens == [3, 4, 3, 4]


def test_lookup_rows_keep_their_own_calibration_in_the_policy():
    """STS temperatures and the live offset are the drafter's: a lookup row's logits are its record."""
    from dspark.drafters.base import DraftBlock
    from dspark.sched.budget_source import TwoStepBudget
    from dspark.speculative.policy import ConfidencePolicy

    policy = ConfidencePolicy(TwoStepBudget(lambda b: 100.0, default_draft_len=2), temperatures=[0.5, 4.0])
    policy.offset.value = -1.0
    z = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    block = DraftBlock(torch.zeros(2, 2, dtype=torch.long), z, torch.zeros(2, 2, 1, dtype=torch.long),
                       torch.ones(2, 2, 1), calibrated=torch.tensor([False, True]))
    survival = policy._survival(block)
    raw = torch.sigmoid(z[1].double()).cumprod(0).numpy()
    assert abs(survival[1] - raw).max() < 1e-9 and abs(survival[0] - raw).max() > 0.01


def test_free_lengths_verify_nothing_before_any_step_time_is_known():
    from dspark.sched.budget_source import ScheduledBudget
    from dspark.speculative.policy import ConfidencePolicy
    from verifier_svc.sps_profile import LiveSps

    target = tiny_target()
    drafter = LookupDrafter(random_drafter(target, "dspark"))
    block = drafter.free_draft(["a", "b"], [[3, 4, 3, 4, 3], [3, 4, 3, 4, 3]])
    sps = LiveSps()  # a verifier started with --sps-warmup-s=0: empty until its first steps
    policy = ConfidencePolicy(ScheduledBudget(default_draft_len=3), free_sps=sps)
    assert policy.free_lengths(block, [4, 4]) == [0, 0]
    sps.observe(2, 0.01)
    sps.observe(10, 0.011)
    assert policy.free_lengths(block, [4, 4]) == [4, 4]  # four guesses at p = 1/2 each, nearly free to verify
    # They promise 1.76x plain decoding's rate: under a scheduler that asks drafting for 2x, none.
    policy.free_min_gain = 2.0
    assert policy.free_lengths(block, [4, 4]) == [0, 0]
    policy.free_min_gain = 1.5
    assert policy.free_lengths(block, [4, 4]) == [4, 4]


def test_in_a_drafted_step_lookup_rows_are_verified_by_their_own_trade_off():
    """The scheduler's budget is the drafter's: in a step that drafts, lookup's rows get the lengths a
    free step would give them (their own survival against the step's cost), the drafter's rows share
    the budget, and the budget source observes the drafter's rows alone."""
    from dspark.drafters.base import DraftBlock
    from dspark.sched.budget_source import ScheduledBudget
    from dspark.speculative.policy import ConfidencePolicy
    from verifier_svc.sps_profile import LiveSps

    sps = LiveSps()
    sps.observe(3, 0.010)
    sps.observe(20, 0.0105)  # verifying rows is nearly free
    source = ScheduledBudget(default_draft_len=3)
    source.push(1)  # the scheduler's budget for the drafter: one token in all
    policy = ConfidencePolicy(source, free_sps=sps)
    observed = []
    source.observe = observed.append
    z = torch.full((3, 6), 4.0)  # every guess ~98% sure
    block = DraftBlock(torch.zeros(3, 6, dtype=torch.long), z, torch.zeros(3, 6, 1, dtype=torch.long),
                       torch.ones(3, 6, 1), calibrated=torch.tensor([True, False, True]))
    assert policy.lengths(block, [6, 6, 4]) == [6, 1, 4]
    assert [o.shape for o in observed] == [(1, 6)]
    drafter_only = DraftBlock(block.tokens, z, block.support_ids, block.support_probs,
                              calibrated=torch.zeros(3, dtype=torch.bool))
    assert sum(policy.lengths(drafter_only, [6, 6, 4])) == 1


def test_in_a_drafted_step_lookup_rows_pay_for_the_whole_steps_rows():
    """Lookup's trade-off in a drafted step is priced at the step's real size: one row for every
    request and the drafter's admitted tokens, not lookup's rows alone (where steps would look flat)."""
    from dspark.drafters.base import DraftBlock
    from dspark.sched.budget_source import ScheduledBudget
    from dspark.speculative.policy import ConfidencePolicy
    from verifier_svc.sps_profile import LiveSps

    sps = LiveSps()
    for tokens, seconds in ((1, 0.010), (4, 0.010), (5, 0.050), (40, 0.400)):
        sps.observe(tokens, seconds)  # flat up to 4 tokens, then each token costs a whole step more
    source = ScheduledBudget(default_draft_len=3)
    source.push(1)
    policy = ConfidencePolicy(source, free_sps=sps)
    z = torch.full((3, 6), 4.0)
    block = DraftBlock(torch.zeros(3, 6, dtype=torch.long), z, torch.zeros(3, 6, 1, dtype=torch.long),
                       torch.ones(3, 6, 1), calibrated=torch.tensor([True, False, False]))
    # 3 requests + the drafter's 1 token = 4: a lookup token would make it 5, 5x the step for ~1 token.
    assert policy.lengths(block, [6, 6, 6]) == [0, 1, 0]
    # Priced alone, one lookup row with 1 + 3 tokens stays in the flat part: it would verify 3.
    alone = np.cumprod(np.full((1, 6), 0.982), axis=1)
    assert policy._lookup_lengths(alone, np.array([6])).tolist() == [3]


def test_the_drafters_report_and_checks_leave_out_the_rows_lookup_filled():
    """A drafted step's block mixes lookup's rows with the drafter's. The step report feeds the
    drafter's budget and calibration, so it carries the drafter's rows only: lookup's confidences,
    earned by lookup, would pass for the drafter's and keep a drafter that does not pay verified."""
    target = tiny_target()
    drafter = LookupDrafter(random_drafter(target, "dspark"))
    blocks = []
    draft = drafter.draft

    def spy(req_ids, *args, **kwargs):
        block = draft(req_ids, *args, **kwargs)
        blocks.append((list(req_ids), block))
        return block

    drafter.draft = spy
    engine = SpecEngine(target, drafter, FixedDraftLen(3), max_batch=4, max_len=256)
    prompts = repetitive_prompts(2) + [[7, 19, 23, 31, 40, 52]]
    seqs = [engine.add(p, SamplingParams(max_tokens=30)) for p in prompts]
    mixed = 0
    while engine.has_work():
        blocks.clear()
        engine.step()
        report = engine.last_report
        if not blocks:
            continue
        req_ids, block = blocks[-1]
        lookup = set() if block.calibrated is None else {r for r, c in zip(req_ids, block.calibrated.tolist()) if c}
        assert not lookup & set(report.req_ids)
        assert len(report.req_ids) == len(report.verified) == len(report.accepted)
        if report.req_ids:
            rows = [req_ids.index(r) for r in report.req_ids]
            assert torch.equal(report.conf_logits, block.conf_logits[rows])
        mixed += bool(lookup) and bool(report.req_ids)
    assert mixed > 0  # steps where both kinds of rows were drafted did happen
    assert [s.output for s in seqs] == greedy_reference(target, prompts, 30)


def test_free_lookups_are_skipped_where_guesses_like_the_recent_ones_cannot_pay():
    """Lookups cost time even when nothing is verified: at a batch where verifying guesses like the
    recent free blocks' (sampled by rank, the best for one request) would not pay, none are looked up,
    but for one look every probe_every steps (the rows may have changed); at a batch where it would
    pay, every step looks. The lookups' own time counts against them, from the model's next verdict on."""
    import numpy as np

    from dspark.sched.budget_source import ScheduledBudget
    from dspark.speculative.policy import FREE_VERDICT_STEPS, ConfidencePolicy

    target = tiny_target()
    drafter = LookupDrafter(random_drafter(target, "dspark", gamma=4))
    block = drafter.free_draft(["a", "b"], [[3, 4, 3, 4, 3], [5, 6, 7, 8, 9]])  # a guesses (p = 1/2 each), b not
    # A step takes max(2, tokens) time units: one request's guess rides along almost free, while at
    # eight requests every verified row costs what a request's token does.
    policy = ConfidencePolicy(ScheduledBudget(3), free_sps=lambda b: 1.0 / np.maximum(2.0, np.asarray(b, float)),
                              probe_every=4)
    assert policy.free_may_pay(8)  # no free block seen yet: look
    policy.free_lengths(block, [4, 4])
    assert policy.free_may_pay(1)
    assert [policy.free_may_pay(8) for _ in range(5)] == [False, False, False, False, True]
    assert policy.free_may_pay(1)
    policy.observe_lookup(2.0, 1)  # a lookup as long as a step: the one guess no longer pays for it
    # The model's verdict stands FREE_VERDICT_STEPS steps of one batch size, then it is weighed again.
    assert [policy.free_may_pay(1) for _ in range(FREE_VERDICT_STEPS)] == [True] * (FREE_VERDICT_STEPS - 1) + [False]


def _policy_after_a_free_block():
    """A scheduled policy (budget 0 pending) whose first look found a lookup block, plain steps 2 time
    units from 1 to 2 requests, and a look every 4 steps."""
    from dspark.sched.budget_source import ScheduledBudget
    from dspark.speculative.policy import ConfidencePolicy

    target = tiny_target()
    block = LookupDrafter(random_drafter(target, "dspark", gamma=4)).free_draft(["a"], [[3, 4, 3, 4, 3]])
    policy = ConfidencePolicy(ScheduledBudget(3), free_sps=lambda b: 1.0 / np.maximum(2.0, np.asarray(b, float)),
                              probe_every=4)
    assert policy.free_may_pay(1)
    policy.free_lengths(block, [4])
    return policy


def test_lookups_stop_where_free_steps_measured_slower_than_plain_ones():
    """The step-time model can promise what steps do not deliver (a jagged or only profiled table):
    where free steps gave fewer tokens a second than plain steps of that batch size give, nothing is
    looked up but for the periodic look, whatever the model says; other batch sizes keep their own
    measure."""
    from dspark.speculative.policy import batch_bucket

    policy = _policy_after_a_free_block()
    policy.observe_free_step(1, 3, 4.0)  # 3 tokens in 4 time units where a plain step gives 1 in 2
    assert policy.free_gain == {1: 1.5} and policy.free_may_pay(1)
    for _ in range(10):
        policy.observe_free_step(1, 1, 3.0)  # nothing accepted, and the step took longer than a plain one
    assert policy.free_gain[1] < 1
    assert [policy.free_may_pay(1) for _ in range(5)] == [False, False, False, False, True]  # and the look
    policy.observe_free_step(3, 6, 2.0)  # three requests (a plain step 3 units): a bucket of their own
    assert batch_bucket(2) == batch_bucket(3) != batch_bucket(1) and policy.free_gain[batch_bucket(3)] == 3.0
    assert policy.free_gain[1] < 1


def test_the_measured_gain_of_free_steps_is_tokens_over_time_and_waits_for_evidence():
    """Free steps' gain is their tokens over their time (a hit weighs what it gave, not one vote in an
    average of per-step ratios), and a first rejected guess or two decide nothing: one request once
    skipped lookups for 200 steps after its first one, and for a third of its steps where hits and
    misses in turn gave 1.6x plain decoding."""
    from dspark.speculative.policy import FREE_GAIN_MIN_STEPS

    assert FREE_GAIN_MIN_STEPS > 2
    policy = _policy_after_a_free_block()
    for _ in range(2):  # misses first: 1 token in 3 units where a plain step gives 1 in 2
        policy.observe_free_step(1, 1, 3.0)
        assert policy.free_gain[1] < 1 and policy.free_may_pay(1)  # too few steps to stop looking
    for _ in range(40):  # then hits and misses in turn: 5 tokens in 4 units, 1 in 3 (per step 2.5 and 0.67)
        policy.observe_free_step(1, 5, 4.0)
        policy.observe_free_step(1, 1, 3.0)
        assert policy.free_may_pay(1)
    assert policy.free_gain[1] == pytest.approx((5 + 1) * 2 / (4 + 3), rel=0.1)  # 1.71: tokens over time
    for _ in range(40):  # a run where nothing is accepted stops the lookups, but for the looks
        policy.observe_free_step(1, 1, 3.0)
    assert policy.free_gain[1] < 1
    assert [policy.free_may_pay(1) for _ in range(5)] == [False, False, False, False, True]


def test_a_policy_that_never_verifies_free_blocks_never_looks_them_up():
    target = tiny_target()
    drafter = LookupDrafter(random_drafter(target, "dspark"))
    calls = []
    free_draft = drafter.free_draft
    drafter.free_draft = lambda *a, **k: calls.append(a) or free_draft(*a, **k)
    engine = SpecEngine(target, drafter, FixedDraftLen(0), max_batch=4, max_len=256)
    prompts = repetitive_prompts(2)
    seqs = engine.generate(prompts, [SamplingParams(max_tokens=20)] * 2)
    assert [s.output for s in seqs] == greedy_reference(target, prompts, 20)
    assert not calls


def test_a_probe_that_lookup_answers_alone_is_made_again_the_next_step():
    """While the budget is 0 a probe is there for the drafter's confidences. Where prompt lookup guesses
    for every request the drafter is not asked and the probe brings none, so the next step probes again
    (one request, lookup guessing on two steps in three: the budget stayed 0 for 300-400 steps
    between useful probes). Output unchanged."""
    from dspark.sched.budget_source import ScheduledBudget
    from dspark.speculative.policy import ConfidencePolicy

    target = tiny_target()
    drafter = LookupDrafter(random_drafter(target, "dspark"))
    source = ScheduledBudget(default_draft_len=3, ttl_steps=10**6, ttl_s=1e9)
    source.push(0)
    policy = ConfidencePolicy(source, probe_every=2)
    probes, step = [], 0  # (step, whether the drafter drafted a row of the block)
    draft = drafter.draft

    def spy(req_ids, *args, **kwargs):
        block = draft(req_ids, *args, **kwargs)
        if policy.probing:
            probes.append((step, block.calibrated is None or not bool(block.calibrated.all())))
        return block

    drafter.draft = spy
    engine = SpecEngine(target, drafter, policy, max_batch=2, max_len=256)
    prompts = repetitive_prompts(2)
    seqs = [engine.add(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, [60, 45])]
    while engine.has_work():
        step += 1
        engine.step()
    assert [s.output for s in seqs] == greedy_reference(target, prompts, 60)[:1] + greedy_reference(target, prompts[1:], 45)
    missed = [s for s, asked in probes if not asked]
    assert missed and any(asked for _, asked in probes)  # both kinds happened
    probe_steps = {s for s, _ in probes}
    assert all(s + 1 in probe_steps for s in missed if s + 1 < step)  # the last step drafts nothing: no room
    assert policy.budget_in_force == 0 and not policy.probing
