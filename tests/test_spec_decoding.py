"""Speculative decoding keeps the target's output exactly (greedy identical, sampling in distribution)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.sampling import SamplingParams
from dspark.speculative.engine import SpecEngine
from dspark.speculative.errors import DrafterUnavailable
from dspark.speculative.policy import FixedDraftLen
from tests.spec_helpers import OracleDrafter, greedy_reference, random_drafter, tiny_target

KINDS = ["dspark", "dflash", "eagle3"]


def prompts_of(lengths, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("concurrent", [1, 8])
def test_greedy_identical_with_random_drafter(kind, concurrent):
    target = tiny_target()
    prompts = prompts_of([5, 17, 9, 30, 3, 12, 22, 7][:concurrent])
    max_tokens = [40, 25, 33, 18, 40, 29, 11, 37][:concurrent]
    engine = SpecEngine(target, random_drafter(target, kind), FixedDraftLen(4), max_batch=8, max_len=256)
    seqs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    for seq, m, p in zip(seqs, max_tokens, prompts):
        assert seq.output == greedy_reference(target, [p], m)[0]
    total = seqs[0].spec.metrics
    for s in seqs[1:]:
        total = total.merge(s.spec.metrics)
    assert total.draft_tokens > 0  # speculation really happened


def test_oracle_drafter_gives_tau_gamma_plus_one():
    target = tiny_target()
    prompts = prompts_of([6, 11, 4])
    gamma, steps = 4, 5
    max_tokens = 1 + steps * (gamma + 1)  # prefill token, then full blocks
    refs = greedy_reference(target, prompts, max_tokens)
    reference = {f"r{i}": p + r for i, (p, r) in enumerate(zip(prompts, refs))}
    engine = SpecEngine(target, OracleDrafter(gamma, [1, 2], reference), FixedDraftLen(gamma), max_batch=4, max_len=256)
    seqs = [engine.add(p, SamplingParams(max_tokens=max_tokens), req_id=f"r{i}") for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    for seq, ref in zip(seqs, refs):
        assert seq.output == ref
        m = seq.spec.metrics
        assert m.drafts == steps and m.draft_tokens == steps * gamma and m.accepted_tokens == steps * gamma
        assert m.acceptance_length == gamma + 1
        assert m.accepted_per_pos == [steps] * gamma
        assert m.conditional_acceptance() == [1.0] * gamma


class FlakyDrafter:
    """Wraps a drafter and fails every other draft call, as a dropped network peer would."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, *a, **k):
        self.calls += 1
        if self.calls % 2 == 0:
            raise DrafterUnavailable("peer gone")
        return self.inner.draft(*a, **k)


def test_drafter_failures_fall_back_to_plain_decoding():
    target = tiny_target()
    prompts = prompts_of([8, 13])
    drafter = FlakyDrafter(random_drafter(target, "dspark"))
    engine = SpecEngine(target, drafter, FixedDraftLen(3), max_batch=4, max_len=256)
    seqs = engine.generate(prompts, SamplingParams(max_tokens=30))
    assert [s.output for s in seqs] == greedy_reference(target, prompts, 30)
    assert drafter.calls > 4


def test_per_request_cap_disables_speculation():
    target = tiny_target()
    engine = SpecEngine(target, random_drafter(target, "dflash"), FixedDraftLen(4), max_batch=4, max_len=256)
    off = engine.add(prompts_of([9])[0], SamplingParams(max_tokens=20), draft_len=0)
    capped = engine.add(prompts_of([7], seed=3)[0], SamplingParams(max_tokens=20), draft_len=2)
    while engine.has_work():
        engine.step()
    assert off.spec.metrics.draft_tokens == 0 and off.spec.metrics.steps > 0
    assert capped.spec.metrics.draft_tokens > 0 and max(len(capped.spec.metrics.verified_per_pos), 0) <= 2


# ---- sampled outputs: same distribution as plain sampling -------------------------------------

def _first_tokens(engine_factory, prompt, params, n_samples, n_tokens=3, max_tokens=5):
    """Joint samples of the first n_tokens, one request per seed, batched many at a time.

    max_tokens 5 = the prefill token + a full block of 3 drafts + the bonus, so tokens 2 and 3
    come out of chained draft verification, not only from the corrected/bonus draw.
    """
    counts = {}
    done = 0
    while done < n_samples:
        engine = engine_factory()
        chunk = min(2000, n_samples - done)
        seqs = [engine.add(prompt, SamplingParams(max_tokens=max_tokens, seed=done + i, **params)) for i in range(chunk)]
        while engine.has_work():
            engine.step()
        for s in seqs:
            key = tuple(s.output[:n_tokens])
            counts[key] = counts.get(key, 0) + 1
        done += chunk
    return counts


def homogeneity(plain: dict, spec: dict, n: int, min_count: int = 40) -> tuple[float, list, list]:
    """Chi-square homogeneity of two samples of n outcomes each: (p value, the outcomes kept, the table).
    Outcomes seen fewer than min_count times in both together are pooled, so that every expected count
    is large enough for chi-square."""
    from scipy.stats import chi2_contingency

    common = [k for k in sorted(set(plain) | set(spec)) if plain.get(k, 0) + spec.get(k, 0) >= min_count]
    table = [[counts.get(k, 0) for k in common] + [n - sum(counts.get(k, 0) for k in common)]
             for counts in (plain, spec)]
    if table[0][-1] + table[1][-1] == 0:  # nothing rare to pool (e.g. top-p removed the tail)
        table = [row[:-1] for row in table]
    return chi2_contingency(table)[1], common, table


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.0, top_p=0.8)],
                         ids=["t1", "t0.6", "t1-topp0.8"])
def test_sampled_first_tokens_match_plain_sampling(params):
    """Chi-square homogeneity test: speculative vs plain sampling, 20,000 samples each, tiny vocab."""
    from dspark.engine.generate import Engine

    vocab = 8
    target = tiny_target(vocab=vocab, seed=5, layers=2, sharpness=3.0)
    drafter = random_drafter(target, "dspark", gamma=3, seed=6, support_size=4)
    prompt = [1, 2, 3]
    n = 20_000
    plain = _first_tokens(lambda: Engine(target, max_batch=2000, max_len=16), prompt, params, n)
    spec = _first_tokens(lambda: SpecEngine(target, drafter, FixedDraftLen(3), max_batch=2000, max_len=16),
                         prompt, params, n)
    p_value, common, table = homogeneity(plain, spec, n)
    assert len(common) >= 10  # a real joint distribution, not a few outcomes
    assert p_value > 0.001, (p_value, table)


def test_confidence_policy_is_lossless_and_adapts_its_budget_to_the_target_cost():
    from dspark.sched.budget_source import TwoStepBudget
    from dspark.speculative.policy import ConfidencePolicy

    target = tiny_target()
    prompts = prompts_of([5, 17, 9, 30, 3, 12])
    # A target whose pass costs almost nothing more per extra token: verifying every draft pays,
    # so once two drafted steps of confidences exist the budget goes past the default 2 per request.
    cheap = ConfidencePolicy(TwoStepBudget(lambda b: 1.0 / (1.0 + 0.001 * np.asarray(b)), default_draft_len=2),
                             explore=0.1)
    engine = SpecEngine(target, random_drafter(target, "dspark"), cheap, max_batch=8, max_len=256)
    seqs = [engine.add(p, SamplingParams(max_tokens=30)) for p in prompts]
    over_default = 0
    while engine.has_work():
        engine.step()
        report = engine.last_report
        over_default += report.drafted and cheap.budget_in_force > 2 * len(report.req_ids)
    assert [s.output for s in seqs] == greedy_reference(target, prompts, 30)
    assert over_default >= 5, over_default
    # A target whose cost explodes with batch tokens: the rule verifies nothing.
    # It then skips the drafter (plain decoding) but for a probe every `probe_every` steps.
    steep = ConfidencePolicy(TwoStepBudget(lambda b: 1.0 / np.asarray(b, dtype=float) ** 4, default_draft_len=2),
                             probe_every=8)
    drafter = random_drafter(target, "dspark")
    engine = SpecEngine(target, drafter, steep, max_batch=8, max_len=256)
    drafted_steps, steps = 0, 0
    seqs = [engine.add(p, SamplingParams(max_tokens=30)) for p in prompts]
    while engine.has_work():
        engine.step()
        steps += 1
        drafted_steps += engine.last_report.drafted
    assert [s.output for s in seqs] == greedy_reference(target, prompts, 30)
    assert steep.budget_in_force == 0
    assert 2 <= drafted_steps <= 1 + steps // 8, (drafted_steps, steps)  # the first step, then probes only
    # Drafting that costs more than a target pass: budget 0 even with a flat SPS and sure drafts.
    costly = TwoStepBudget(lambda b: 10.0, default_draft_len=2, draft_cost=lambda r: 1.0)
    assert costly.budget(2) == 4  # no confidences yet: the default per request
    costly.observe(np.full((2, 4), 0.5))
    assert costly.budget(2) == 0 and not ConfidencePolicy(costly).should_draft(2)
    # A probe answered in the background (a remote drafter) counts as a drafted step's confidences.
    flat = TwoStepBudget(lambda b: 10.0, default_draft_len=2)
    ConfidencePolicy(flat).observe_probe(torch.full((2, 4), 6.0))  # sure drafts on a flat SPS: all of them
    assert flat.next_budget(2) == 8
    free = TwoStepBudget(lambda b: 10.0, default_draft_len=2, draft_cost=lambda r: 0.01)
    free.observe(np.full((2, 4), 0.5))
    assert free.budget(2) > 0 and ConfidencePolicy(free).should_draft(2)


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                                    dict(temperature=1.0, top_p=0.8)], ids=["greedy", "t1", "t0.7-topk5", "t1-topp"])
def test_a_step_without_drafts_samples_as_the_verification_would(params):
    """SpecEngine samples a step with no drafts as plain decoding does (sample_rows). Chain rejection
    with zero drafts must give the same token from the same uniform, so that shortcut changes no
    seeded request's output: checked row by row on the same logits and seeds."""
    from dspark.engine.sampler import row_probs, sample_rows
    from dspark.engine.sequence import Sequence
    from dspark.speculative.rejection import draw_uniforms, rejection_sample_auto

    logits = torch.randn(64, 40, generator=torch.Generator().manual_seed(1)) * 3

    def seqs():
        return [Sequence([1], SamplingParams(seed=i, **params)) for i in range(64)]

    plain = sample_rows(logits, seqs())
    verifying = seqs()
    lens = [0] * len(verifying)
    u_acc, u_res = draw_uniforms(lens, [s.generator for s in verifying])
    _, out = rejection_sample_auto(row_probs(logits, verifying), torch.empty(0, dtype=torch.long),
                                   torch.empty(0, 1, dtype=torch.long), torch.empty(0, 1), torch.tensor(lens),
                                   u_acc, u_res)
    assert out[:, 0].tolist() == plain
    assert params["temperature"] == 0 or len(set(plain)) > 5  # real draws, not one token
