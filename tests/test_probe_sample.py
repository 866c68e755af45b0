"""A probe at a large batch drafts for a few requests in turn (dspark/speculative/engine.py
PROBE_SAMPLE): only theirs are taken in and drafted, the step report holds their rows and says how
many rows of the batch they stand for, and the output stays the target's."""
from __future__ import annotations

import torch

from dspark.sampling import SamplingParams
from dspark.sched.budget_source import ScheduledBudget
from dspark.speculative.engine import PROBE_SAMPLE, SpecEngine
from dspark.speculative.policy import ConfidencePolicy
from tests.spec_helpers import greedy_reference, random_drafter, tiny_target


def prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 64, (3 + i % 4,), generator=g).tolist() for i in range(count)]


def run_probing(count: int, max_tokens: int = 40):
    """`count` greedy requests under a budget of 0 (probes only, every other step): what each probe
    drafted and took in, its step report, and the outputs beside plain greedy decoding's."""
    target = tiny_target()
    drafter = random_drafter(target, "dspark")
    source = ScheduledBudget(default_draft_len=3, ttl_steps=10**6, ttl_s=1e9)
    source.push(0)
    policy = ConfidencePolicy(source, probe_every=2)
    engine = SpecEngine(target, drafter, policy, max_batch=count, max_len=256)
    drafted, taken_in = [], []
    draft, extend = drafter.draft, drafter.extend_context
    drafter.draft = lambda req_ids, *a, **k: drafted.append(list(req_ids)) or draft(req_ids, *a, **k)
    drafter.extend_context = lambda req_id, *a, **k: taken_in.append(req_id) or extend(req_id, *a, **k)
    seqs = [engine.add(p, SamplingParams(max_tokens=max_tokens)) for p in prompts(count)]
    probes = []
    while engine.has_work():
        drafted.clear(), taken_in.clear()
        engine.step()
        if drafted:
            report = engine.last_report
            probes.append(dict(drafted=drafted[0], taken_in=set(taken_in), reported=list(report.req_ids),
                               sample_of=report.sample_of, verified=list(report.verified)))
    return probes, [s.output for s in seqs], greedy_reference(target, prompts(count), max_tokens), seqs


def test_a_probe_at_a_large_batch_drafts_for_a_few_requests_in_turn():
    probes, outputs, reference, seqs = run_probing(8)
    assert outputs == reference
    assert len(probes) >= 4
    ids = [s.req_id for s in seqs]
    for probe in probes:
        assert len(probe["drafted"]) == PROBE_SAMPLE
        assert probe["taken_in"] <= set(probe["drafted"])  # the others' positions wait
        assert sorted(probe["reported"]) == sorted(probe["drafted"]) and not any(probe["verified"])
        assert probe["sample_of"] == 8  # every sampled row was the drafter's: 4 stand for 8
    # In turn: two probes cover the batch, the third starts over.
    assert set(probes[0]["drafted"]) | set(probes[1]["drafted"]) == set(ids)
    assert set(probes[0]["drafted"]).isdisjoint(probes[1]["drafted"])
    assert probes[2]["drafted"] == probes[0]["drafted"]


def test_a_small_batch_probes_every_request():
    probes, outputs, reference, seqs = run_probing(PROBE_SAMPLE)
    assert outputs == reference
    assert probes and all(sorted(p["drafted"]) == sorted(s.req_id for s in seqs) for p in probes)
    assert all(p["sample_of"] == 0 for p in probes)  # the rows stand for themselves
