import json
from collections import deque
from functools import lru_cache

import numpy as np
import pytest
from scipy.stats import chisquare

from dspark.sched.budget_source import TwoStepBudget
from dspark.sched.prefix_scheduler import (admit_top_k, budget_from_survival, causal_greedy, lookahead_search,
                                           prefix_survival)
from dspark.sched.sps import SpsTable


def theta(lengths, a, sps):
    a = np.asarray(a, dtype=np.float64)
    tau = sum(1.0 + a[r, :n].sum() for r, n in enumerate(lengths))
    return tau * sps(int(np.sum(1 + np.asarray(lengths))))


# ---------------------------------------------------------------- SPS table


def test_sps_from_samples_uses_median_and_interpolates_step_time():
    table = SpsTable.from_samples([1, 1, 1, 3], [0.010, 0.011, 0.500, 0.030])
    assert table.seconds(1) == pytest.approx(0.011)  # the 0.5 s outlier is ignored
    assert table.seconds(2) == pytest.approx(0.0205)  # linear in seconds between neighbours
    assert table(2) == pytest.approx(1 / 0.0205)


def test_sps_extrapolation_is_monotone_safe():
    table = SpsTable({4: 0.02, 8: 0.01})  # jagged: 8 tokens measured faster than 4
    assert table.seconds(1) == pytest.approx(0.02)  # below the range: never faster than measured
    assert table.seconds(6) == pytest.approx(0.015)  # between neighbours
    assert table.seconds(16) == pytest.approx(0.02)  # beyond: time per token kept, SPS keeps falling
    assert table(16) < table(12) < table(8)
    np.testing.assert_allclose(table.seconds(np.array([4, 8, 16])), [0.02, 0.01, 0.02])


def test_sps_ema_and_dict_round_trip():
    table = SpsTable({2: 0.010}, ema_weight=0.25)
    assert table.seconds(2) == pytest.approx(0.010)  # an answer before a step must not outlive it
    table.observe(2, 0.020)
    assert table.seconds(2) == pytest.approx(0.0125)
    assert table.seconds(5) == pytest.approx(0.0125 * 5 / 2)
    table.observe(5, 0.040)  # an unmeasured B starts its own bucket
    assert table.seconds(5) == pytest.approx(0.040)
    restored = SpsTable.from_dict(json.loads(json.dumps(table.to_dict())))
    assert restored.seconds_by_tokens == table.seconds_by_tokens
    assert restored.ema_weight == 0.25
    with pytest.raises(ValueError):
        table.observe(3, 0.0)


def test_sps_answers_one_b_as_it_answers_many():
    """One B is answered without numpy (after every step): the same seconds as the array path, below,
    on, between and beyond the measured points."""
    rng = np.random.default_rng(3)
    table = SpsTable({int(b): float(s) for b, s in zip(rng.choice(np.arange(1, 200), 9, replace=False),
                                                        rng.uniform(0.005, 0.05, 9))})
    queries = np.arange(0, 260)
    many = table.seconds(queries)
    assert [table.seconds(int(b)) for b in queries] == pytest.approx(list(many), rel=1e-12)
    assert [table.seconds(np.int64(b)) for b in queries[:5]] == pytest.approx(list(many[:5]), rel=1e-12)
    assert table(7) == pytest.approx(1.0 / table.seconds(7))


def test_profile_points_follow_the_live_level_so_a_stale_one_never_makes_more_tokens_look_cheaper():
    """Serving, B = 16 took 3x its profile time; B = 24 was never seen live. Interpolating between
    live 16 (87 ms) and the stale profile 32 (43 ms) made 24 tokens cheaper than 16, and verifying
    prompt lookup's guesses looked like a gain at 16 requests. The profile's points now follow
    the live level, and the same guesses are not worth their cost."""
    table = SpsTable()
    table.set_profile({8: 0.025, 16: 0.029, 32: 0.043})
    assert table.seconds(16) == pytest.approx(0.029)
    for _ in range(30):
        table.observe(16, 0.087)
    assert table.level == pytest.approx(0.087 / 0.029)
    assert table.seconds(16) == pytest.approx(0.087) and table.seconds(32) == pytest.approx(0.043 * table.level)
    assert table.seconds(24) > table.seconds(16) and table.seconds(8) == pytest.approx(0.025 * table.level)
    survival = np.zeros((16, 7))
    survival[:8, 0] = 0.6  # 8 requests with a one-token guess at 60%
    assert budget_from_survival(survival, table, min_gain=1.3) == 0
    stale = SpsTable({8: 0.025, 16: 0.087, 32: 0.043})  # a live 16 beside profile points as measured
    assert budget_from_survival(survival, stale, min_gain=1.3) > 0


# ---------------------------------------------------------------- Algorithm 1


def test_prefix_survival_is_cumulative_product():
    np.testing.assert_allclose(prefix_survival([[0.9, 0.5, 0.2]]), [[0.9, 0.45, 0.09]])


def test_causal_greedy_stops_at_first_drop():
    a = np.array([[0.9, 0.5, 0.45]])
    sps = SpsTable.from_sps({1: 1.0, 2: 0.6, 3: 0.35, 4: 0.5})
    # Theta by length: 1.0, 1.14, 0.84 (drop), 1.425 (better, but behind the drop)
    assert causal_greedy(a, sps).tolist() == [1]
    assert lookahead_search(a, sps).tolist() == [3]


def test_causal_greedy_keeps_prefix_order_across_requests():
    a = np.array([[0.9, 0.3], [0.6, 0.5]])
    sps = lambda tokens: 1.0 / (1.0 + 0.1 * (tokens - 2))  # noqa: E731
    # Order: (0,1) 0.9, (1,1) 0.6, (1,2) 0.5, (0,2) 0.3; Theta 2, 2.64, 2.92, 3.08, then 3.07 (drop).
    assert causal_greedy(a, sps).tolist() == [1, 2]


def test_causal_greedy_breaks_ties_by_position_then_request():
    a = np.full((2, 2), 0.5)
    sps = SpsTable.from_sps({2: 1.0, 3: 0.9, 4: 0.8, 5: 0.7, 6: 0.5})  # Theta 2, 2.25, 2.4, 2.45, 2.0
    assert causal_greedy(a, sps).tolist() == [2, 1]  # (0,1), (1,1), then (0,2) before (1,2)


def test_causal_greedy_flat_sps_admits_every_positive_survival():
    a = np.array([[0.9, 0.4, 0.0], [0.2, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert causal_greedy(a, lambda tokens: 1.0).tolist() == [2, 1, 0]


def test_causal_greedy_steep_sps_admits_nothing():
    a = np.array([[0.99, 0.98], [0.97, 0.9]])
    assert causal_greedy(a, lambda tokens: 2.0 ** -(tokens - 2)).tolist() == [0, 0]


def test_rising_survival_is_rejected():
    with pytest.raises(ValueError):
        causal_greedy(np.array([[0.5, 0.6]]), lambda tokens: 1.0)


# ---------------------------------------------------------------- two-step rule


def test_budget_finds_the_global_optimum_on_a_jagged_table():
    a = np.array([[0.9, 0.5, 0.45, 0.4]])
    sps = SpsTable.from_sps({1: 1.0, 2: 0.6, 3: 0.35, 4: 0.5, 5: 0.3})
    # Theta(K): 1.0, 1.14, 0.84, 1.425, 0.975: a first-drop stop would settle on K = 1.
    assert causal_greedy(a, sps).tolist() == [1]
    assert budget_from_survival(a, sps) == 3


def test_budget_matches_exhaustive_search_on_random_cases():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = prefix_survival(rng.uniform(0.3, 1.0, size=(2, 3)))
        sps = SpsTable.from_sps({b: rng.uniform(0.2, 1.0) for b in range(2, 9)})
        budget = budget_from_survival(a, sps)
        best = theta(lookahead_search(a, sps), a, sps)
        assert theta(admit_top_k(a, budget), a, sps) == pytest.approx(best)


def test_draft_cost_is_paid_only_when_drafting():
    # Flat SPS (memory-bound target): 1 request, survivals 0.6, 0.36, 0.216.
    a = prefix_survival(np.array([[0.6, 0.6, 0.6]]))
    sps = lambda tokens: np.full(np.shape(tokens), 10.0)  # noqa: E731  0.1 s per pass
    assert budget_from_survival(a, sps) == 3  # free drafting: verify everything
    # Theta(3) = 2.176 / (0.1 + d) beats Theta(0) = 1 / 0.1 while d < 0.1176 s.
    assert budget_from_survival(a, sps, draft_seconds=0.11) == 3
    assert budget_from_survival(a, sps, draft_seconds=0.12) == 0


def test_budget_takes_smallest_on_ties():
    assert budget_from_survival(np.zeros((2, 3)), lambda tokens: 1.0) == 0


def test_admit_top_k_orders_by_survival_then_position():
    a = np.array([[0.9, 0.3, 0.1], [0.6, 0.5, 0.4]])
    assert admit_top_k(a, 0).tolist() == [0, 0]
    assert admit_top_k(a, 3).tolist() == [1, 2]
    assert admit_top_k(a, 4).tolist() == [1, 3]
    assert admit_top_k(a, 100).tolist() == [3, 3]
    assert admit_top_k(np.full((2, 2), 0.5), 3).tolist() == [2, 1]


def test_admit_top_k_caps():
    a = np.array([[0.9, 0.8], [0.7, 0.6], [0.95, 0.9]])
    assert admit_top_k(a, 4, caps=[1, 2, 0]).tolist() == [1, 2, 0]  # request 2 has speculation off
    assert admit_top_k(a, 2, caps=[2, 2, 0]).tolist() == [2, 0, 0]
    assert admit_top_k(a, 3, caps=None).tolist() == [1, 0, 2]


def test_admit_top_k_is_the_prefix_closed_top_k_on_random_cases():
    rng = np.random.default_rng(1)
    for _ in range(50):
        conf = rng.choice([0.5, 0.8, 1.0], size=(4, 5))  # coarse values: many exact ties
        a = prefix_survival(conf)
        budget = int(rng.integers(0, 25))
        caps = rng.integers(0, 6, size=4)
        lengths = admit_top_k(a, budget, caps)
        assert np.all(lengths <= caps)
        assert lengths.sum() == min(budget, caps.sum())
        key = lambda r, j: (-a[r, j], j, r)  # noqa: E731
        admitted = [key(r, j) for r in range(4) for j in range(lengths[r])]
        left_out = [key(r, j) for r in range(4) for j in range(lengths[r], caps[r])]
        if admitted and left_out:
            assert max(admitted) < min(left_out)


# ---------------------------------------------------------------- Appendix A: the look-ahead bias

TARGET_P = np.array([0.7, 0.3])  # target distribution over a 2-token vocabulary {0, 1}
DRAFT_Q = np.array([0.5, 0.5])
PAPER_SPS = SpsTable.from_sps({1: 1.0, 2: 0.5, 3: 0.45})


def block_survival(x1):
    """a = (0.8, 0.8) after x_1 = 0, (0.8, 0.2) after x_1 = 1 (c_2 reads x_1, as the paper's head does)."""
    return prefix_survival([[0.8, 1.0 if x1 == 0 else 0.25]])


def draw(dist, rng):
    return int(rng.random() >= dist[0])  # inverse CDF over 2 tokens


def chain_rejection(drafts, length, rng):
    """Standard chain rejection sampling: accept x with prob min(1, p/q), else draw from
    norm(max(0, p - q)) and stop; if all `length` drafts pass, add a bonus token from p."""
    out = []
    for x in drafts[:length]:
        if rng.random() < min(1.0, TARGET_P[x] / DRAFT_Q[x]):
            out.append(x)
            continue
        residual = np.maximum(TARGET_P - DRAFT_Q, 0.0)
        out.append(draw(residual / residual.sum(), rng))
        return out
    out.append(draw(TARGET_P, rng))
    return out


def first_two_outputs(choose_length, episodes, seed):
    """Per episode (a fresh request), run steps until two tokens are out; return them [episodes, 2]."""
    rng = np.random.default_rng(seed)
    outputs = np.zeros((episodes, 2), dtype=np.int64)
    for e in range(episodes):
        out = []
        while len(out) < 2:
            drafts = [draw(DRAFT_Q, rng), draw(DRAFT_Q, rng)]
            out += chain_rejection(drafts, choose_length(drafts[0]), rng)
        outputs[e] = out[:2]
    return outputs


def cached_by_first_token(schedule):
    """The schedules below are deterministic in a, and a depends only on x_1: compute each once."""
    return lru_cache(maxsize=None)(lambda x1: int(schedule(block_survival(x1))[0]))


def two_step_scheduler(sps):
    """K from the survivals of two steps earlier (0 until there are any), top-K by current a.
    Like above, both decisions are cached by the first token they are computed from."""
    budget_after = lru_cache(maxsize=None)(lambda x1: budget_from_survival(block_survival(x1), sps))
    length_for = lru_cache(maxsize=None)(lambda x1, budget: int(admit_top_k(block_survival(x1), budget)[0]))
    earlier_first_tokens = deque(maxlen=2)

    def choose_length(x1):
        budget = budget_after(earlier_first_tokens[0]) if len(earlier_first_tokens) == 2 else 0
        earlier_first_tokens.append(x1)
        return length_for(x1, budget)

    return choose_length


def chi_square_p(tokens):
    return chisquare(np.bincount(tokens, minlength=2), TARGET_P * tokens.size).pvalue


EPISODES = 20000


@pytest.mark.parametrize(
    "biased_schedule",
    [
        lambda a: lookahead_search(a, PAPER_SPS),
        # The two-step rule without its delay: K from the very drafts it admits is just as biased.
        lambda a: admit_top_k(a, budget_from_survival(a, PAPER_SPS)),
    ],
    ids=["lookahead search", "budget from current drafts"],
)
def test_appendix_a_lookahead_is_biased(biased_schedule):
    """Paper Appendix A, rebuilt from method.md 5: 1 request, gamma = 2, c_1 = 0.8, c_2 set by
    x_1 (so a_2 = 0.8 after x_1 = 0, 0.2 after x_1 = 1), SPS = (1.0, 0.5, 0.45) at B = 1, 2, 3,
    p = (0.7, 0.3), q = (0.5, 0.5). Theta = 1.0 (verify none), 0.9 (verify x_1), 0.45 * (1.8 + a_2)
    = 1.17 or 0.90 (verify both). The look-ahead search verifies both when x_1 = 0 and none
    when x_1 = 1: x_1 decides whether x_1 itself is verified. Verified, x_1 = 0 is always
    accepted (p/q > 1); otherwise the first output is a fresh draw from p. So the first output
    token is 0 with probability 0.5 * 1 + 0.5 * 0.7 = 0.85, the paper's (0.85, 0.15).
    (Counting the anchor as output position 1, this is the second output position.)"""
    outputs = first_two_outputs(cached_by_first_token(biased_schedule), EPISODES, seed=0)
    first = outputs[:, 0]
    share_of_zero = np.mean(first == 0)
    assert abs(share_of_zero - 0.85) < 4 * np.sqrt(0.85 * 0.15 / EPISODES)
    assert chi_square_p(first) < 1e-12
    assert chi_square_p(outputs[:, 1]) < 1e-6  # the next position inherits the bias (expected 0.775)


@pytest.mark.parametrize(
    "name, sps",
    [
        ("paper SPS", PAPER_SPS),  # Algorithm 1 verifies nothing here; two-step K is 0 or 2
        ("cheaper 2-token pass", SpsTable.from_sps({1: 1.0, 2: 0.6, 3: 0.45})),  # x_2 verified iff x_1 = 0
    ],
)
def test_appendix_a_our_schedulers_keep_the_target_distribution(name, sps):
    for schedule in (cached_by_first_token(lambda a: causal_greedy(a, sps)), two_step_scheduler(sps)):
        outputs = first_two_outputs(schedule, EPISODES, seed=1)
        assert chi_square_p(outputs[:, 0]) > 0.001, name
        assert chi_square_p(outputs[:, 1]) > 0.001, name


def test_appendix_a_cases_really_speculate():
    """Guard: the lossless cases above must actually verify drafts, or they would prove nothing."""
    cheaper = SpsTable.from_sps({1: 1.0, 2: 0.6, 3: 0.45})
    assert [causal_greedy(block_survival(x1), cheaper)[0] for x1 in (0, 1)] == [2, 1]
    assert [budget_from_survival(block_survival(x1), PAPER_SPS) for x1 in (0, 1)] == [2, 0]
    assert [lookahead_search(block_survival(x1), PAPER_SPS)[0] for x1 in (0, 1)] == [2, 0]


def test_a_minimum_gain_keeps_plain_decoding_unless_drafting_promises_more():
    """The margin is for batches, whose requests finish at different steps (the slowest decides
    the wall time, which the per-step model cannot see): it applies from two requests on."""
    sps = lambda b: np.full(np.shape(b), 50.0)  # noqa: E731  20 ms a pass at any B
    a = prefix_survival(np.full((2, 4), 0.5))  # each promises 0.94 draft tokens: 1.94 tokens vs 1 a step
    assert budget_from_survival(a, sps, draft_seconds=0.01) == 8  # 1.94 / 30 ms = 1.29x plain
    assert budget_from_survival(a, sps, draft_seconds=0.01, min_gain=1.3) == 0
    assert budget_from_survival(a, sps, draft_seconds=0.0, min_gain=1.3) == 8  # 1.94x
    assert budget_from_survival(a[:1], sps, draft_seconds=0.01, min_gain=1.3) == 4  # one request: any gain


def test_a_row_left_to_the_drafter_is_priced_at_the_whole_step():
    """Prompt lookup guesses for most requests of a batch and the drafter drafts the rest: the budget
    for the drafter's rows weighs their tokens against the step of every request, not of those rows."""
    sps = lambda b: 1.0 / (0.006 + 0.001 * np.asarray(b))  # noqa: E731  7 ms a pass at one token, 22 at 16
    a = prefix_survival(np.full((1, 4), 0.8))  # one drafter row promising 2.4 draft tokens
    assert budget_from_survival(a, sps, draft_seconds=0.003) == 4  # alone: 3.4 tokens in 14 ms against 1 in 7
    # In a 16-request step the same row adds 2.4 tokens to 16 for 7 ms more (a 22 ms pass): not worth it.
    assert budget_from_survival(a, sps, draft_seconds=0.003, requests=16) == 0
    assert budget_from_survival(a, sps, draft_seconds=0.003, requests=1) == 4  # fewer than the rows: the rows
    in_process = TwoStepBudget(sps, default_draft_len=3, draft_cost=lambda rows: 0.003)  # the same, in process
    in_process.observe(a)
    assert (in_process.budget(1), in_process.next_budget(1), in_process.budget(16), in_process.next_budget(16)) \
        == (4, 4, 0, 0)
    # And the margin asked of batches applies to the batch: 4.4 / 15 ms = 1.29x plain for one row of two.
    two = lambda b: np.full(np.shape(b), 50.0)  # noqa: E731  20 ms a pass at any B
    b = prefix_survival(np.full((1, 4), 0.9))
    assert budget_from_survival(b, two, draft_seconds=0.0, requests=2, min_gain=1.3) == 4  # (2 + 3.1) / 2 = 2.55x
    assert budget_from_survival(b, two, draft_seconds=0.02, requests=2, min_gain=1.3) == 0  # 2.55 / 2 = 1.27x
