"""In-process units of confidence scheduling's service pieces: the verifier's BudgetControl and
its ConfidencePolicy on a ScheduledBudget (scheduler budget, fallback, temperatures), the SPS
warm-up, the scheduler's BudgetPlanner and OnlineCalibrator on the in-process store."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from spec_helpers import tiny_target
from test_calibration import GAMMA, overconfident_traffic

from dspark.engine.generate import Engine
from dspark.proto_gen.v1 import load_pb2, tensor_pb2
from dspark.sched.calibration import OnlineCalibrationStats, apply_sts
from dspark.sched.prefix_scheduler import admit_top_k
from dspark.sched.prefix_scheduler import budget_from_survival
from dspark.sched.verify_budget import calibrated_survival, pooled_survival
from scheduler_svc.budget_planner import BudgetPlanner, seconds_table
from scheduler_svc.calibration_store import Fit, MemoryCalibrationStore
from scheduler_svc.online_calibration import OnlineCalibrator
from verifier_svc.budget_control import BudgetControl
from verifier_svc.sps_profile import profile_token_counts, warmup_profile


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def block(logits):
    return SimpleNamespace(conf_logits=torch.tensor(logits, dtype=torch.float32))


def calibration(version, temps, drafter_version="v1"):
    temps = np.asarray(temps, dtype="<f4")
    return load_pb2.Calibration(drafter_version=drafter_version, version=version, temperatures=tensor_pb2.Tensor(
        dtype=tensor_pb2.DTYPE_F32, shape=[temps.size], data=temps.tobytes()))


def decision(budget=0, decided=True, **kw):
    return load_pb2.BudgetDecision(verify_budget=budget, decided=decided, **kw)


def scheduled(default_draft_len, clock=None, probe_every=16, gamma=4, **ttl):
    """A BudgetControl as the verifier builds it, on a drafter of block size gamma."""
    control = BudgetControl(probe_every=probe_every, **ttl)
    control.make_policy(SimpleNamespace(gamma=gamma, version="v1"), default_draft_len)
    if clock is not None:
        control.source.clock = clock
    return control


LOGITS = [[3.0, 2.0, 1.0, 0.0], [2.5, -1.0, -2.0, -3.0], [0.5, 0.0, -1.0, -4.0]]


def test_scheduler_budget_then_last_budget_then_default_draft_len():
    clock = Clock()
    control = scheduled(1, clock, ttl_steps=3, ttl_s=2.0)
    policy, source = control.policy, control.source

    def step(caps, logits=LOGITS):
        policy.should_draft(len(caps))
        return policy.lengths(block(logits) if logits is not None else SimpleNamespace(conf_logits=None), caps)

    caps = [4, 4, 4]
    default = admit_top_k(calibrated_survival(LOGITS), 3, np.array(caps)).tolist()  # 1 per request x 3
    assert default == [2, 1, 0]
    assert step(caps) == default and not source.from_scheduler
    control.apply(decision(7, decided=False))  # no decision: nothing changes
    assert step(caps) == default
    control.apply(decision(7))
    want = admit_top_k(calibrated_survival(LOGITS), 7, np.array(caps)).tolist()
    assert sum(want) == 7
    assert step(caps) == want and source.from_scheduler and policy.budget_in_force == 7
    for _ in range(5):  # many steps, little time: the last budget stays
        assert step(caps) == want
    clock.now = 2.5  # and now both limits have passed: the default
    assert step(caps) == default and not source.from_scheduler
    control.apply(decision(0))  # a real budget of 0: verify nothing
    assert policy.lengths(block(LOGITS), caps) == [0, 0, 0] and source.from_scheduler
    # Draft lengths (overrides, room) still bound every request.
    control.apply(decision(12))
    assert step([0, 2, 4]) == [0, 2, 4]
    # No confidences (DFlash/EAGLE-3): the fixed default per request.
    assert step([4, 4], logits=None) == [1, 1] and not source.from_scheduler


def test_temperatures_newer_version_of_the_same_drafter_only():
    control = scheduled(1)
    control.apply(decision(decided=False, calibration=calibration(2, [2.0, 2.0, 3.0, 3.0])))
    np.testing.assert_allclose(control.policy.temperatures, [2, 2, 3, 3])
    assert control.calibration_version == 2
    for stale in (calibration(1, [5.0] * 4), calibration(3, [5.0] * 4, "v0"), calibration(4, [5.0] * 3),
                  calibration(5, [5.0, -1.0, 1.0, 1.0])):
        assert not control.set_calibration(stale)
    np.testing.assert_allclose(control.policy.temperatures, [2, 2, 3, 3])
    want = admit_top_k(np.cumprod(apply_sts(LOGITS, [2.0, 2.0, 3.0, 3.0]), axis=1), 4, np.array([4, 4, 4]))
    control.apply(decision(4))
    assert control.policy.lengths(block(LOGITS), [4, 4, 4]) == want.tolist()


def test_warmup_profile_measures_each_b_and_leaves_the_cache_empty():
    engine = Engine(tiny_target(), max_batch=4, max_len=64)
    table = warmup_profile(engine, max_tokens=20, repeats=2)
    assert profile_token_counts(20) == [1, 2, 4, 8, 16, 20]
    assert sorted(table.seconds_by_tokens) == [1, 2, 4, 8, 16, 20]
    assert all(s > 0 for s in table.seconds_by_tokens.values())
    assert engine.cache.num_free == 4 and sum(engine.cache.lengths) == 0


def test_budget_planner_uses_the_newest_report_and_the_published_sps():
    planner = BudgetPlanner()
    points = [[1, 0.010], [4, 0.0105], [8, 0.0167], [16, 0.05]]  # [B, step seconds]
    logits = np.array(LOGITS)
    assert planner.on_report("v", 1, logits, None, []) is None  # no SPS table yet: no decision
    budget = planner.on_report("v", 2, logits, None, points)
    table = seconds_table(points)
    warm = calibrated_survival(logits)
    assert budget == budget_from_survival(pooled_survival([warm], 3), table) and planner.budgets["v"] == budget
    assert planner.on_report("v", 1, logits - 5, None, points) == budget  # older report: ignored
    cold = planner.on_report("v", 3, logits, np.full(4, 4.0), points)  # pooled with the report before
    assert cold == budget_from_survival(pooled_survival([warm, calibrated_survival(logits, np.full(4, 4.0))], 3), table)
    # Only the newest reports count: POOLED_REPORTS of them, more while they hold fewer than
    # POOLED_BLOCKS blocks (six of these three-row reports).
    for step in range(4, 9):
        planner.on_report("v", step, logits - 6, None, points)
    assert planner.on_report("v", 9, logits - 6, None, points) == 0
    planner.forget("v")
    assert "v" not in planner.budgets


def test_online_calibrator_refits_from_the_store_and_refuses_older_fits():
    logits, accepted, verified = overconfident_traffic(seed=1, num=4000)
    store = MemoryCalibrationStore()
    calibrator = OnlineCalibrator(store, refit_reports=10, refit_s=1e9, min_samples=100)
    for rows in np.array_split(np.arange(len(logits)), 40):
        calibrator.add("v1", logits[rows], accepted[rows], verified[rows])
    asyncio.run(calibrator.tick())
    expected = OnlineCalibrationStats(GAMMA)
    expected.add(logits, accepted, verified)
    fit = calibrator.fits["v1"]
    assert fit.version == 1
    np.testing.assert_allclose(fit.temperatures, expected.fit(min_samples=100))
    np.testing.assert_array_equal(fit.samples, expected.num_samples)
    reply = calibrator.calibration("v1")
    assert reply.version == 1 and reply.drafter_version == "v1"
    np.testing.assert_allclose(np.frombuffer(reply.temperatures.data, "<f4"), fit.temperatures, rtol=1e-6)
    older = Fit(0, np.ones(GAMMA), expected.num_samples - 1, np.zeros(GAMMA))
    assert asyncio.run(store.save_fit("v1", older)) == 0  # fewer samples than the stored fit
    assert calibrator.calibration("nothing") is None


def test_planner_weighs_the_published_draft_cost():
    sps = [[b, 0.1] for b in range(1, 40)]  # flat: 0.1 s per target pass, any B
    sure = np.full((3, GAMMA), 4.0)  # confident drafts
    planner = BudgetPlanner()
    assert planner.on_report("v", 1, sure, None, sps, [[1, 0.01], [8, 0.02]]) == 3 * GAMMA
    # Drafting that costs more than the tokens it saves: budget 0 (the verifier then skips the drafter).
    assert planner.on_report("v", 2, sure, None, sps, [[1, 2.0], [8, 3.0]]) == 0


def test_budget_control_splits_step_time_into_target_pass_and_drafting():
    from dspark.speculative.engine import StepReport

    control = BudgetControl()
    control.make_policy(SimpleNamespace(gamma=GAMMA, version="v1"), default_draft_len=2)
    first = StepReport(batch_size=2, batch_tokens=6, seconds=0.9, draft_seconds=0.6, drafted=True,
                       req_ids=["a", "b"], verified=[2, 2], accepted=[1, 0], draft_resumed=True)
    control.on_step(first)  # the first draft after skipped steps: not what drafting on costs
    control.on_step(StepReport(batch_size=2, batch_tokens=6, seconds=0.5, draft_seconds=0.2, drafted=True,
                               req_ids=["a", "b"], verified=[2, 2], accepted=[1, 0], draft_context_rows=5))
    control.on_step(StepReport(batch_size=3, batch_tokens=3, seconds=0.25, draft_seconds=0.01, drafted=False,
                               verified=[], accepted=[]))
    assert control.sps.items() == [(3, 0.25), (6, pytest.approx(0.3))]  # the skipped step's 0.01 s is not drafting
    # A skipped step that verified 3 of lookup's guesses (kept out of the drafter's report) is a
    # step at 5 tokens; a pass with a prompt in it is no decode step.
    control.on_step(StepReport(batch_size=2, batch_tokens=5, seconds=0.28, drafted=False))
    control.on_step(StepReport(batch_size=2, batch_tokens=40, seconds=2.0, drafted=False, prefill=True))
    assert control.sps.items() == [(3, 0.25), (5, 0.28), (6, pytest.approx(0.3))]
    assert control.draft_cost.items() == [(2, 0.2)]
    control.on_step(first)  # again after a skipped step
    assert control.draft_cost.items() == [(2, 0.2)]
    # A draft that first took in the 90 positions of two prompts is catch-up, not what a step costs.
    control.on_step(StepReport(batch_size=2, batch_tokens=6, seconds=1.5, draft_seconds=1.2, drafted=True,
                               req_ids=["a", "b"], verified=[2, 2], accepted=[1, 0], draft_context_rows=90,
                               draft_resumed=True))
    assert control.draft_cost.items() == [(2, 0.2)]
    # Prompt lookup filled every row (none in the report): the drafter's model did not run, 0.01 s is
    # no draft's cost. Lookup filled one of two rows: the drafter drafted one, which is what it costs.
    control.on_step(StepReport(batch_size=2, batch_tokens=12, seconds=0.4, draft_seconds=0.01, drafted=True))
    control.on_step(StepReport(batch_size=2, batch_tokens=9, seconds=0.4, draft_seconds=0.15, drafted=True,
                               req_ids=["b"], verified=[2], accepted=[1], draft_context_rows=3))
    assert control.draft_cost.items() == [(1, 0.15), (2, 0.2)]
    load = control.fill_load(load_pb2.VerifierLoad())
    assert [(p.requests, p.seconds) for p in load.draft_cost] == [(1, pytest.approx(0.15)), (2, pytest.approx(0.2))]
    # The scheduler's --min-draft-gain holds prompt lookup's free blocks too; 0 (not sent) keeps it.
    assert control.policy.free_min_gain == 1.0
    control.apply(decision(0, min_draft_gain=1.3))
    control.apply(decision(0))
    assert control.policy.free_min_gain == pytest.approx(1.3)
    # Fixed draft length (--schedule=off): the scheduler's budget is never applied.
    control.make_policy(SimpleNamespace(gamma=GAMMA, version="v1"), default_draft_len=2, scheduled=False)
    control.apply(decision(0))
    assert control.policy.should_draft(3) and control.policy.lengths(None, [4, 4]) == [2, 2]


def test_budget_zero_skips_the_drafter_but_probes_and_expires():
    clock = Clock()
    control = scheduled(2, clock, probe_every=4, ttl_steps=20, ttl_s=1.0)
    policy, source = control.policy, control.source
    assert policy.should_draft(3)  # no decision yet: the default draft length drafts
    control.apply(decision(0))
    decisions = [(policy.should_draft(1), policy.probing) for _ in range(60)]
    probes = [i + 1 for i, (draft, _) in enumerate(decisions) if draft]
    # The verifier's drafter is remote: the first probe at once, then gaps of 2, 4, 8, 16 (4 x 4 at one
    # request) at most.
    assert probes == [1, 3, 7, 15, 31, 47]
    assert all(probing == draft for draft, probing in decisions)  # each one only a probe: none verified
    assert policy.budget_in_force == 0
    # The scheduler goes silent: skipped steps count towards its budget's expiry like drafted ones.
    control.apply(decision(0))  # a fresh budget of 0 ...
    clock.now = 5.0
    for _ in range(20):  # ... then silence: 20 steps
        policy.should_draft(3)
    assert policy.should_draft(3) and not source.from_scheduler and source.budget(3) == 6


def test_planner_pools_the_survivals_of_its_newest_reports_only():
    points = [[1, 0.010], [4, 0.0105], [8, 0.0167], [16, 0.05]]
    logits = np.array(LOGITS)
    for pooled in (1, 3):
        planner = BudgetPlanner(pooled_reports=pooled, pooled_blocks=0)
        planner.on_report("v", 1, logits - 8, None, points)  # a report that promises nothing
        for step in range(2, 2 + pooled):
            budget = planner.on_report("v", step, logits, None, points)
        # the weak report has left the window: the budget is that of the good ones alone
        assert budget == budget_from_survival(calibrated_survival(logits), seconds_table(points)) > 0
    planner = BudgetPlanner(pooled_reports=4)
    planner.on_report("v", 1, logits - 8, None, points)
    assert planner.on_report("v", 2, logits, None, points) == budget_from_survival(
        pooled_survival([calibrated_survival(logits - 8), calibrated_survival(logits)], 3), seconds_table(points))


def test_one_requests_budget_pools_more_reports_until_they_hold_enough_blocks():
    """One request's report is one block: the pool keeps its newest reports until they hold
    pooled_blocks blocks, where four of them made the budget flip from step to step."""
    points = [[1, 0.010], [4, 0.0105], [8, 0.0167], [16, 0.05]]
    good, weak = np.array(LOGITS[:1]), np.array(LOGITS[:1]) - 8
    planner = BudgetPlanner(pooled_reports=4, pooled_blocks=8)
    for step in range(1, 5):
        planner.on_report("v", step, good, None, points)
    for step in range(5, 9):  # four weak blocks after four good ones: still the mean of all eight
        budget = planner.on_report("v", step, weak, None, points)
    survivals = [calibrated_survival(good)] * 4 + [calibrated_survival(weak)] * 4
    assert len(planner._recent["v"]) == 8
    assert budget == budget_from_survival(pooled_survival(survivals, 1), seconds_table(points)) > 0
    # Reports of a call come in together and the oldest beyond the pool leave.
    planner.on_reports("v", [(step, weak) for step in range(9, 13)], None, points)
    assert len(planner._recent["v"]) == 8 and sum(len(s) for s in planner._recent["v"]) == 8
    assert planner.on_report("v", 13, weak, None, points) == 0  # eight weak blocks now
    # Several requests: four reports hold enough blocks.
    many = BudgetPlanner(pooled_reports=4, pooled_blocks=8)
    for step in range(1, 7):
        many.on_report("v", step, np.array(LOGITS), None, points)
    assert len(many._recent["v"]) == 4


def test_planner_takes_a_calls_reports_at_once_as_it_would_one_by_one():
    """ReportSteps brings several steps: they join the pool together and the budget is computed once,
    the same budget as reporting them one at a time; steps already used are ignored."""
    points = [[1, 0.010], [4, 0.0105], [8, 0.0167], [16, 0.05]]
    logits = np.array(LOGITS)
    reports = [(step, logits + shift) for step, shift in zip(range(1, 8), [-6, 1, -2, 0.5, -1, 2, -0.5])]
    one_by_one = BudgetPlanner(pooled_reports=4)
    for step, conf in reports:
        expected = one_by_one.on_report("v", step, conf, None, points)
    at_once = BudgetPlanner(pooled_reports=4)
    assert at_once.on_reports("v", reports, None, points) == expected
    assert list(map(np.ndarray.tolist, at_once._recent["v"])) == list(map(np.ndarray.tolist, one_by_one._recent["v"]))
    assert at_once.on_reports("v", [(3, logits - 9)], None, points) == expected  # an older step: ignored


def test_an_in_process_policy_probes_after_probe_every_skipped_steps():
    """In process a probe is a draft on the target's own thread: it waits probe_every steps first."""
    from dspark.sched.budget_source import ScheduledBudget
    from dspark.speculative.policy import ConfidencePolicy

    source = ScheduledBudget(default_draft_len=2, ttl_steps=1000, ttl_s=1e9)
    policy = ConfidencePolicy(source, probe_every=4)
    source.push(0)
    probes = [i + 1 for i in range(60) if policy.should_draft(1)]
    assert probes == [4, 12, 28, 44, 60]  # after 4 skipped steps, then 8, then 16 (4 x 4) at most


def test_probes_wait_longer_at_more_requests_and_no_longer_than_a_smaller_batch_would():
    """A steady "no" stands longer the more requests the step has (up to 16 x probe_every from four on):
    a probe drafts and first takes in what its rows missed, and at many requests drafting rarely pays.
    A smaller batch waits no longer than its own longest gap."""
    from dspark.sched.budget_source import ScheduledBudget
    from dspark.speculative.policy import ConfidencePolicy

    source = ScheduledBudget(default_draft_len=2, ttl_steps=1000, ttl_s=1e9)
    policy = ConfidencePolicy(source, probe_every=4)
    source.push(0)
    probes = [i + 1 for i in range(300) if policy.should_draft(8)]
    assert probes == [4, 12, 28, 60, 124, 188, 252]  # gaps 8, 16, 32, 64, then 64 (16 x 4) at most
    assert not any(policy.should_draft(5) for _ in range(10))  # three requests less: the "no" stands
    # Two requests, 58 steps after the last probe: their longest gap is 32 (8 x 4), so a probe at once,
    # then 32 steps on.
    assert [i + 1 for i in range(64) if policy.should_draft(2)] == [1, 33]
    source.push(1)
    assert policy.should_draft(2)  # a budget: drafting again, and the gaps start over
    source.push(0)
    assert [i + 1 for i in range(12) if policy.should_draft(2)] == [4, 12]


def test_a_missed_probe_is_made_again_at_once_and_keeps_the_gaps():
    """A probe that brought no confidences (prompt lookup answered every request) is made again the
    next step; the probes after it keep the gaps they would have had."""
    from dspark.sched.budget_source import ScheduledBudget
    from dspark.speculative.policy import ConfidencePolicy

    source = ScheduledBudget(default_draft_len=2, ttl_steps=1000, ttl_s=1e9)
    policy = ConfidencePolicy(source, probe_every=4)
    source.push(0)
    probes = []
    for step in range(1, 41):
        if policy.should_draft(3):
            probes.append(step)
            if step in (4, 5):
                policy.probe_missed()
                assert not policy.probing
    assert probes == [4, 5, 6, 14, 30]


def test_shipped_temperatures_until_the_online_fit(tmp_path):
    import json

    from dspark.drafters.checkpoint import load_calibration

    (tmp_path / "calibration.json").write_text(json.dumps({"temperatures": [0.5, 1.0, 2.0, 3.0],
                                                           "drafter_version": "v1"}))
    assert load_calibration(tmp_path, "v1") == [0.5, 1.0, 2.0, 3.0]
    assert load_calibration(tmp_path, "v2") is None  # fitted for another checkpoint
    assert load_calibration(tmp_path / "nowhere", "v1") is None
    shipped = np.array([0.5, 1.0, 2.0, 3.0])
    control = BudgetControl()
    drafter = SimpleNamespace(gamma=4, version="v1", sts_temperatures=shipped)
    policy = control.make_policy(drafter, default_draft_len=1)
    np.testing.assert_array_equal(policy.temperatures, shipped)
    control.apply(decision(decided=False, calibration=calibration(1, [2.0, 2.0, 2.0, 2.0])))
    np.testing.assert_array_equal(policy.temperatures, [2.0, 2.0, 2.0, 2.0])  # the online fit replaces it


def test_planner_drafts_for_a_verifier_whose_drafts_do_better_than_promised():
    """Confidences that under-promise (each token survives with sigmoid(z + 2)) keep the budget at
    0 until the verifier's own outcomes move its offset; another verifier is not affected."""
    from test_calibration import shifted_traffic

    sps = [[b, 0.02] for b in range(1, 40)]  # flat: 20 ms a pass
    cost = [[1, 0.012], [4, 0.012]]  # drafting adds 12 ms
    z = np.full((1, GAMMA), -1.0)  # promises 0.27, 0.07, ...: not worth 12 ms
    planner = BudgetPlanner()
    assert planner.on_report("v", 1, z, None, sps, cost) == 0
    traffic_z, accepted, verified = shifted_traffic(seed=6, shift=2.0, num=120)
    for rows in np.array_split(np.arange(120), 30):
        planner.learn("v", traffic_z[rows], None, accepted[rows], verified[rows])
    assert planner.offsets["v"].value > 1.4
    assert planner.on_report("v", 100, z, None, sps, cost) > 0
    assert planner.on_report("w", 1, z, None, sps, cost) == 0
    planner.forget("v")
    assert "v" not in planner.offsets


def test_planner_weighs_drafted_steps_by_how_long_they_really_took():
    """Drafted steps that run twice as long as the SPS and draft-cost tables say make drafting lose
    to plain decoding; plain steps (their own table is kept current by the verifier) do not count."""
    sps = [[b, 0.02] for b in range(1, 40)]  # 20 ms a pass
    cost = [[1, 0.005], [4, 0.01]]  # drafting adds 5-10 ms
    z = np.full((2, GAMMA), 0.0)  # promises ~1 draft token a request
    fresh = BudgetPlanner()
    assert fresh.on_report("v", 1, z, None, sps, cost) > 0
    slow = BudgetPlanner()
    for _ in range(20):
        slow.observe_step("v", 2, 2, 0.060, False, sps, cost)  # plain: ignored
    assert slow.drafted_scale("v") == 1.0
    for _ in range(20):  # drafted steps at B = 8 took 60 ms where the tables say 27
        slow.observe_step("v", 2, 8, 0.060, True, sps, cost)
    assert slow.drafted_scale("v") > 2.0 and slow.on_report("v", 1, z, None, sps, cost) == 0
    for _ in range(20):  # they speed up to what the tables say: drafting pays again
        slow.observe_step("v", 2, 8, 0.027, True, sps, cost)
    assert slow.drafted_scale("v") < 1.1 and slow.on_report("v", 2, z, None, sps, cost) > 0


def test_a_probes_sample_is_priced_as_drafting_for_the_rows_it_stands_for():
    """A probe at a large batch drafts a few requests (PROBE_SAMPLE): their confidences are the level
    of the batch's, but a budget from them is a draft of every row the drafter would take, priced so.
    Four sure rows of a 16-request step pay for their own draft (2 ms); as a sample of 16 rows the
    draft costs 50 ms and does not."""
    from dspark.sched.budget_source import TwoStepBudget
    from dspark.speculative.policy import ConfidencePolicy

    sps = [[b, 1.0 / rate] for b, rate in [(1, 100.0), (4, 97.0), (16, 80.0), (32, 60.0), (64, 35.0), (128, 18.0)]]
    draft_cost = [[1, 0.001], [4, 0.002], [16, 0.05]]
    sure = np.full((4, GAMMA), 4.0)
    planner = BudgetPlanner(min_gain=1.3)
    assert planner.on_report("alone", 1, sure, None, sps, draft_cost, requests=16) == 4 * GAMMA
    assert planner.on_report("sampled", 1, sure, None, sps, draft_cost, requests=16, sample_of=16) == 0
    # In process the policy's source gets the sample standing for the rows: the same prices.
    table, cost = seconds_table(sps), seconds_table(draft_cost)
    for sample_of, expected in ((0, 4 * GAMMA), (16, 0)):
        source = TwoStepBudget(table, default_draft_len=3, draft_cost=cost.seconds)
        policy = ConfidencePolicy(source)
        policy.lengths(block(sure), [GAMMA] * 4, sample_of)
        assert len(source.history[-1]) == max(4, sample_of)
        assert source.next_budget(16) == expected


def test_prefix_reuse_is_counted_in_the_verifiers_metrics():
    from dspark.serving import metrics
    from dspark.speculative.engine import StepReport

    control = BudgetControl()
    before = metrics.PREFIX_REUSED_TOKENS._value.get()
    control.on_step(StepReport(batch_size=2, batch_tokens=40, seconds=0.3, prefill=True, prefix_reused=24))
    control.on_step(StepReport(batch_size=2, batch_tokens=2, seconds=0.1))
    assert metrics.PREFIX_REUSED_TOKENS._value.get() - before == 24
