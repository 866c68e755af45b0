"""Draft-ahead in one process (dspark/drafters/ahead.py): the next block drafted on a thread beside
the target's pass, on the guess that this block is accepted; used only where the guess held.
The remote drafter's draft-ahead is tested in test_context_push.py and test_services_failures.py."""
from __future__ import annotations

import pytest
import torch

from dspark.drafters.ahead import DraftAheadThread, Guesses
from dspark.sampling import SamplingParams
from dspark.speculative.engine import SpecEngine
from dspark.speculative.policy import FixedDraftLen
from tests.spec_helpers import OracleDrafter, greedy_reference, random_drafter, tiny_target
from tests.test_spec_decoding import prompts_of


def test_a_guess_holds_only_for_its_token_at_its_position():
    guesses = Guesses(["a", "b", "c"], [10, 12, 7], [5, 6, 7])
    assert guesses.held(["c", "a", "b", "d"], [7, 10, 13, 1], [7, 5, 6, 1]) == [0, 1]  # b: one position off


def test_an_oracle_drafting_ahead_has_every_guess_hold_and_waits_for_no_draft():
    """Verifying 2 of 4 drafts a step, every guess (2 accepted, the third the target's own) holds:
    after the first block every block comes from the draft ahead."""
    target = tiny_target()
    prompts = prompts_of([5, 9])
    reference = {f"r{i}": p + out for i, (p, out) in enumerate(zip(prompts, greedy_reference(target, prompts, 30)))}
    oracle = OracleDrafter(4, [1, 2], reference)
    oracle.drafts_ahead = True
    drafter = DraftAheadThread(oracle)
    engine = SpecEngine(target, drafter, FixedDraftLen(2), max_batch=2, max_len=256)
    seqs = [engine.add(p, SamplingParams(max_tokens=30), req_id=f"r{i}") for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    for i, seq in enumerate(seqs):
        assert seq.prompt + seq.output == reference[f"r{i}"]
        assert seq.spec.metrics.acceptance_length == pytest.approx(3.0, abs=0.35)  # 2 drafts + the bonus
    assert drafter.rows_used > 0 and drafter.rows_used >= drafter.rows_ahead - 2  # all but each request's last
    drafter.close()


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
@pytest.mark.parametrize("verify", [1, 3])
def test_greedy_text_is_the_targets_with_a_random_drafter_drafting_ahead(kind, verify):
    target = tiny_target()
    prompts = prompts_of([5, 17, 9, 30, 3, 12])
    max_tokens = [40, 25, 33, 18, 40, 29]
    drafter = DraftAheadThread(random_drafter(target, kind))
    engine = SpecEngine(target, drafter, FixedDraftLen(verify), max_batch=8, max_len=256)
    seqs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    for seq, m, p in zip(seqs, max_tokens, prompts):
        assert seq.output == greedy_reference(target, [p], m)[0]
    assert drafter.rows_ahead > 0
    drafter.close()


def test_eagle3_does_not_draft_ahead():
    with pytest.raises(ValueError, match="does not draft ahead"):
        DraftAheadThread(random_drafter(tiny_target(), "eagle3"))


def _tokens_3_and_4(engine_factory, prompt, n_samples):
    """Tokens 3 and 4 of unseeded T = 1 requests (seeded ones never draft ahead), 2,000 at a time:
    token 4 comes out of the third step, whose block was drafted ahead when token 3 was guessed."""
    counts = {}
    torch.manual_seed(0)
    while sum(counts.values()) < n_samples:
        engine = engine_factory()
        seqs = [engine.add(prompt, SamplingParams(max_tokens=6, temperature=1.0)) for _ in range(2000)]
        while engine.has_work():
            engine.step()
        for s in seqs:
            counts[tuple(s.output[2:4])] = counts.get(tuple(s.output[2:4]), 0) + 1
    return counts


def test_sampled_tokens_drafted_ahead_follow_the_targets_distribution():
    """Chi-square of tokens 3-4 (verified from blocks that may have been drafted ahead) against
    plain sampling, 20,000 requests each."""
    from scipy.stats import chi2_contingency

    from dspark.engine.generate import Engine

    target = tiny_target(vocab=16, sharpness=4.0)
    prompt = [3, 7, 2]
    inner = random_drafter(target, "dspark", gamma=3)
    drafters = []

    def speculative():
        drafters.append(DraftAheadThread(inner))
        return SpecEngine(target, drafters[-1], FixedDraftLen(1), max_batch=2000, max_len=64)

    ahead = _tokens_3_and_4(speculative, prompt, 20_000)
    plain = _tokens_3_and_4(lambda: Engine(target, max_batch=2000, max_len=64), prompt, 20_000)
    assert sum(d.rows_used for d in drafters) > 500  # many blocks really came from drafts ahead
    keys = [k for k in set(ahead) | set(plain) if ahead.get(k, 0) + plain.get(k, 0) >= 20]
    table = [[ahead.get(k, 0) for k in keys], [plain.get(k, 0) for k in keys]]
    _, p_value, _, _ = chi2_contingency(table)
    assert p_value > 1e-3
    for d in drafters:
        d.close()
