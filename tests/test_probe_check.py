"""Unverified greedy drafts checked against the target afterwards (dspark/speculative/probe_check.py):
the outcome a check reports is the one verification reports for the same draft."""
from __future__ import annotations

import torch
from spec_helpers import OracleDrafter, greedy_reference, tiny_target

from dspark.drafters import DraftBlock
from dspark.sampling import SamplingParams
from dspark.sched.budget_source import ScheduledBudget
from dspark.speculative.engine import SpecEngine
from dspark.speculative.policy import ConfidencePolicy, FixedDraftLen
from dspark.speculative.probe_check import ProbeChecks, check_outcome

GAMMA = 4


def test_check_outcome_settles_once_every_guessed_position_is_decided():
    assert check_outcome([5, 6, 7], [5, 9], finished=False) is None  # position 3 not decided yet
    assert check_outcome([5, 6, 7], [5, 9, 1], finished=False) == (1, 3)  # token 2 rejected
    assert check_outcome([5, 6, 7], [5, 6, 7, 8], finished=False) == (3, 3)
    assert check_outcome([5, 6, 7], [5, 6], finished=True) == (2, 2)  # ended: what was decided
    assert check_outcome([5, 6, 7], [4], finished=True) == (0, 1)
    assert check_outcome([5, 6, 7], [], finished=True) is None  # nothing decided at all


def test_probe_checks_wait_for_the_target_and_drop_aborted_requests():
    class Seq:
        def __init__(self, tokens, done=False):
            self.tokens, self.done = tokens, done

    checks = ProbeChecks()
    checks.add("a", 3, [7, 8], torch.tensor([1.0, 2.0]))
    checks.add("a", 4, [8, 5], torch.tensor([3.0, 4.0]))
    checks.add("gone", 1, [7], torch.tensor([0.0, 0.0]))
    assert checks.collect({"a": Seq([1, 2, 3, 7])}) is None and len(checks) == 2  # "gone" dropped
    conf, accepted, verified = checks.collect({"a": Seq([1, 2, 3, 7, 8, 6])})
    assert conf.tolist() == [[1.0, 2.0], [3.0, 4.0]] and (accepted, verified) == ([2, 1], [2, 2])
    checks.add("a", 6, [1, 2], torch.tensor([5.0, 6.0]))
    assert checks.collect({"a": Seq([1, 2, 3, 7, 8, 6, 1], done=True)})[1:] == ([1], [1])
    assert not len(checks)


class NoisyOracle(OracleDrafter):
    """The target's greedy continuation with one token wrong at a place set by the anchor position,
    and confidences that name the position: the same draft wherever the same context drafts."""

    has_confidence = True

    def __init__(self, reference, vocab: int):
        super().__init__(GAMMA, [1, 2], reference)
        self.vocab, self.anchor_of = vocab, {}

    def draft(self, req_ids, anchors, temperatures, generators):
        block = super().draft(req_ids, anchors, temperatures, generators)
        tokens, conf = block.tokens.clone(), []
        for i, req in enumerate(req_ids):
            a = self.ctx[req]
            wrong = (a * 5 + int(req[1:])) % (GAMMA + 2)
            if wrong < GAMMA:
                tokens[i, wrong] = (tokens[i, wrong] + 1) % self.vocab
            row = torch.tensor([a + 0.25 * k - 20.0 + 100 * int(req[1:]) for k in range(GAMMA)])
            self.anchor_of[(req, tuple(row.tolist()))] = a
            conf.append(row)
        return DraftBlock(tokens=tokens, conf_logits=torch.stack(conf), support_ids=tokens[..., None],
                          support_probs=torch.ones(tokens.shape + (1,)))


def _outcomes(engine, drafter, prompts, checked: bool) -> dict:
    """(request, anchor position) -> (accepted, verified) from the step reports."""
    seqs = [engine.add(p, SamplingParams(max_tokens=40), req_id=f"r{i}") for i, p in enumerate(prompts)]
    found = {}
    while engine.has_work():
        engine.step()
        r = engine.last_report
        conf, accepted, verified = ((r.checked_conf, r.checked_accepted, r.checked_verified) if checked
                                    else (r.conf_logits, r.accepted, r.verified))
        if conf is None:
            continue
        req_ids = r.req_ids if not checked else [None] * len(accepted)
        for row, a, v, req in zip(conf, accepted, verified, req_ids):
            key = next(k for k in drafter.anchor_of if k[1] == tuple(row.tolist()) and (req is None or k[0] == req))
            found[(key[0], drafter.anchor_of[key])] = (a, v)
    return found, [s.output for s in seqs]


def test_a_checked_draft_gets_the_outcome_verification_gives_the_same_draft():
    target = tiny_target()
    prompts = [[5, 9, 11, 3], [7, 2, 8]]
    outputs = greedy_reference(target, prompts, 40)
    reference = {f"r{i}": p + o for i, (p, o) in enumerate(zip(prompts, outputs))}
    vocab = target.config.vocab_size

    verifying = NoisyOracle(reference, vocab)
    verified, out_a = _outcomes(SpecEngine(target, verifying, FixedDraftLen(GAMMA), max_batch=2, max_len=128),
                                verifying, prompts, checked=False)
    skipping = NoisyOracle(reference, vocab)
    source = ScheduledBudget(default_draft_len=GAMMA)
    source.push(0)  # budget 0: every step drafts (probe_every 1) and verifies none of it
    checked, out_b = _outcomes(SpecEngine(target, skipping, ConfidencePolicy(source, probe_every=1), max_batch=2,
                                          max_len=128), skipping, prompts, checked=True)
    assert out_a == outputs and out_b == outputs  # lossless both ways
    both = [k for k in verified if k in checked and verified[k][1] == GAMMA]
    assert len(both) >= 8, (len(verified), len(checked))
    for key in both:
        accepted, _ = verified[key]
        assert checked[key] == (accepted, GAMMA), key
    assert {a for a, _ in checked.values()} >= {0, 1, GAMMA}  # rejections early, late and none


def test_a_step_reports_the_context_its_draft_took_in_first():
    """A drafter that was skipped takes in every position it missed before it drafts (the draft-cost
    table must not count that); a drafter kept current takes in one position per request."""
    target = tiny_target()
    prompts = [[5, 9, 11, 3], [7, 2, 8]]
    outputs = greedy_reference(target, prompts, 12)
    reference = {f"r{i}": p + o for i, (p, o) in enumerate(zip(prompts, outputs))}
    engine = SpecEngine(target, NoisyOracle(reference, target.config.vocab_size), FixedDraftLen(GAMMA), max_batch=2,
                        max_len=128)
    for i, p in enumerate(prompts):
        engine.add(p, SamplingParams(max_tokens=12), req_id=f"r{i}")
    rows = []
    while engine.has_work():
        engine.step()
        report = engine.last_report
        rows.append((report.drafted, report.draft_context_rows, report.draft_resumed))
    assert rows[0] == (False, 0, False)  # the prefill step drafts nothing
    assert rows[1] == (True, sum(len(p) for p in prompts), True)  # both prompts' positions first: resumed
    assert all(n <= 2 * (1 + GAMMA) and not resumed for drafted, n, resumed in rows[2:])  # then each step's
