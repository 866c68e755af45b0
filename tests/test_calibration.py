import json

import numpy as np
import pytest

from dspark.sched.calibration import LiveOffset, OnlineCalibrationStats, apply_sts, fit_sts, sigmoid
from dspark.sched.metrics import auroc, ece, per_position_calibration, plot_reliability, prefix_survival_pairs

GAMMA = 7
INFLATION = 2.5


def overconfident_traffic(seed, num=20000):
    """Draft blocks whose true per-token survival is sigmoid(t_k) (t shares a per-block
    difficulty, so positions are correlated), reported as inflated logits z = 2.5 t.
    Verification lengths vary, and nothing past a block's verified length is a label."""
    rng = np.random.default_rng(seed)
    difficulty = rng.normal(0.0, 0.7, size=(num, 1))
    true_logit = 2.0 - 0.15 * np.arange(GAMMA) + difficulty + rng.normal(0.0, 1.2, size=(num, GAMMA))
    survives = rng.random((num, GAMMA)) < sigmoid(true_logit)
    first_failure = np.argmin(np.concatenate([survives, np.zeros((num, 1), bool)], axis=1), axis=1)
    verified_len = rng.integers(0, GAMMA + 1, size=num)
    accepted_len = np.minimum(first_failure, verified_len)
    return INFLATION * true_logit, accepted_len, verified_len


@pytest.fixture(scope="module")
def traffic():
    return overconfident_traffic(seed=0)


@pytest.fixture(scope="module")
def offline_temperatures(traffic):
    return fit_sts(*traffic)


# ---------------------------------------------------------------- metrics by hand


def test_ece_by_hand():
    pred, label = [0.1, 0.2, 0.8, 0.9], [0, 1, 1, 1]
    assert ece(pred, label) == pytest.approx((0.1 + 0.8 + 0.2 + 0.1) / 4)  # one sample per bin
    # 2 bins: [0.1, 0.2] -> |0.5 - 0.15|, [0.8, 0.9] -> |1 - 0.85|, each half the weight
    assert ece(pred, label, bins=2) == pytest.approx(0.5 * 0.35 + 0.5 * 0.15)
    assert ece([1.0, 1.0], [1, 1]) == 0.0  # a prediction of exactly 1 lands in the last bin
    # weights count as repeated samples; fractional labels are observed rates
    expected = ece([0.2] * 4 + [0.6], [0, 0, 1, 1, 1])
    assert ece([0.2, 0.6], [0.5, 1.0], weights=[4, 1]) == pytest.approx(expected)
    assert expected == pytest.approx((4 * 0.3 + 0.4) / 5)


def test_auroc_by_hand():
    assert auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    # ties count one half: positives {0.5, 0.9} vs negatives {0.5, 0.5} -> (0.5 + 0.5 + 1 + 1) / 4
    assert auroc([0.5, 0.5, 0.5, 0.9], [0, 1, 0, 1]) == pytest.approx(0.75)
    assert auroc([0.3, 0.3, 0.3], [0, 1, 1]) == pytest.approx(0.5)
    assert np.isnan(auroc([0.2, 0.4], [1, 1]))


def test_per_position_calibration_by_hand():
    conf = np.array([[0.5, 0.4], [0.9, 0.5], [0.8, 0.5]])
    accepted_len, verified_len = [1, 2, 0], [2, 1, 2]
    report = per_position_calibration(conf, accepted_len, verified_len)
    # position 1: preds 0.5, 0.9, 0.8 with labels 1, 1, 0, each alone in its bin
    # position 2: only blocks 0 and 2 were verified that far: preds 0.2, 0.4, labels 0, 0
    np.testing.assert_array_equal(report.count, [3, 2])
    np.testing.assert_allclose(report.ece, [1.4 / 3, 0.3])
    assert report.auroc[0] == pytest.approx(0.5)
    assert np.isnan(report.auroc[1])  # only negatives there
    assert report.mean_ece == pytest.approx((1.4 + 0.6) / 5)


def test_reliability_plot_writes_png(tmp_path, traffic):
    logits, accepted_len, verified_len = traffic
    pred, label, _ = prefix_survival_pairs(sigmoid(logits), accepted_len, verified_len)
    path = tmp_path / "reliability.png"
    plot_reliability({"raw": (pred, label)}, path, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000


# ---------------------------------------------------------------- STS


def test_apply_sts_divides_each_position_by_its_temperature():
    np.testing.assert_allclose(apply_sts([[0.0, 2.0], [4.0, -2.0]], [1.0, 2.0]), sigmoid([[0.0, 1.0], [4.0, -1.0]]))


def test_sts_fixes_overconfidence_and_keeps_order(traffic, offline_temperatures):
    logits, accepted_len, verified_len = traffic
    raw = per_position_calibration(sigmoid(logits), accepted_len, verified_len)
    calibrated = per_position_calibration(apply_sts(logits, offline_temperatures), accepted_len, verified_len)
    assert raw.mean_ece > 0.05
    assert calibrated.mean_ece < 0.02
    assert np.all((offline_temperatures > 1.8) & (offline_temperatures < 3.5))  # near the 2.5 inflation
    assert calibrated.auroc[0] == raw.auroc[0]  # one temperature cannot reorder one position
    np.testing.assert_allclose(calibrated.auroc, raw.auroc, atol=0.02)  # products barely reorder


def test_sts_ignores_positions_that_were_not_verified():
    rng = np.random.default_rng(3)
    num = 4000
    logits = rng.normal(0.0, 2.0, size=(num, 2))
    survives = rng.random((num, 2)) < sigmoid(logits)  # calibrated at T = 1
    accepted_len = np.where(survives[:, 0], np.where(survives[:, 1], 2, 1), 0)
    verified_len = np.full(num, 2)
    # Blocks that were never verified: confident logits, no outcome (accepted_len 0 by force).
    logits[num // 2 :] = 8.0
    accepted_len[num // 2 :] = 0
    verified_len[num // 2 :] = 0
    temperatures = fit_sts(logits, accepted_len, verified_len)
    assert np.all(np.abs(np.log(temperatures)) < np.log(1.3))
    treated_as_labels = fit_sts(logits, accepted_len)  # what happens without verified_len
    assert treated_as_labels[0] > 2.0


def test_positions_without_data_keep_unit_temperature():
    logits = np.array([[3.0, 3.0], [-3.0, 3.0]])
    assert fit_sts(logits, [1, 0], [1, 1])[1] == 1.0
    stats = OnlineCalibrationStats(2)
    stats.add(logits, [1, 0], [1, 1])
    assert stats.fit()[1] == 1.0
    np.testing.assert_array_equal(stats.num_samples, [2, 0])


def test_positions_with_too_few_outcomes_keep_their_prior(traffic):
    """A position reached fewer than min_samples times keeps the shipped temperature (or 1); one
    with enough is fitted as before."""
    logits, accepted_len, verified_len = traffic
    stats = OnlineCalibrationStats(logits.shape[1])
    stats.add(logits, accepted_len, verified_len)
    counts, full = stats.num_samples, stats.fit()
    floor = int(np.sort(counts)[len(counts) // 2]) + 1  # about half the positions fall short
    short = counts < floor
    assert short.any() and (~short).any()
    prior = np.linspace(0.5, 2.0, logits.shape[1])
    gated = stats.fit(min_samples=floor, prior=prior)
    np.testing.assert_array_equal(gated[short], prior[short])
    np.testing.assert_array_equal(gated[~short], full[~short])
    np.testing.assert_array_equal(stats.fit(min_samples=floor)[short], 1.0)


def test_online_refit_lands_close_to_offline_fit(traffic, offline_temperatures):
    logits, accepted_len, verified_len = traffic
    # Two scheduler replicas each see half the traffic, in chunks; their stats are merged.
    replicas = [OnlineCalibrationStats(GAMMA), OnlineCalibrationStats(GAMMA)]
    for i, chunk in enumerate(np.array_split(np.arange(len(accepted_len)), 8)):
        replicas[i % 2].add(logits[chunk], accepted_len[chunk], verified_len[chunk])
    online_temperatures = replicas[0].merge(replicas[1]).fit()

    def mean_ece(temperatures):
        return per_position_calibration(apply_sts(logits, temperatures), accepted_len, verified_len).mean_ece

    assert mean_ece(online_temperatures) < mean_ece(offline_temperatures) + 0.02
    assert mean_ece(online_temperatures) < 0.02
    np.testing.assert_allclose(online_temperatures, offline_temperatures, rtol=0.25)


def test_online_stats_merge_and_serialise(traffic):
    logits, accepted_len, verified_len = traffic
    whole = OnlineCalibrationStats(GAMMA)
    whole.add(logits, accepted_len, verified_len)
    first, second = OnlineCalibrationStats(GAMMA), OnlineCalibrationStats(GAMMA)
    first.add(logits[:5000], accepted_len[:5000], verified_len[:5000])
    second.add(logits[5000:], accepted_len[5000:], verified_len[5000:])
    merged = first.merge(second)
    np.testing.assert_array_equal(merged.reached, whole.reached)
    np.testing.assert_array_equal(merged.accepted, whole.accepted)
    # position k counts blocks whose tokens 1..k-1 were accepted and k was verified
    assert whole.num_samples[0] == np.sum(verified_len >= 1)
    assert whole.num_samples[2] == np.sum((accepted_len >= 2) & (verified_len >= 3))

    restored = OnlineCalibrationStats.from_dict(json.loads(json.dumps(merged.to_dict())))
    np.testing.assert_array_equal(restored.reached, whole.reached)
    np.testing.assert_array_equal(restored.accepted, whole.accepted)
    np.testing.assert_array_equal(restored.fit(), whole.fit())
    with pytest.raises(ValueError):
        whole.merge(OnlineCalibrationStats(GAMMA, bin_width=0.125))


def shifted_traffic(seed, shift, num=200):
    """Blocks whose reported logits z are right but for an offset: each token survives with
    sigmoid(z + shift) (the drafter does better, shift > 0, or worse than its confidences say)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.0, 1.5, size=(num, GAMMA))
    survives = rng.random((num, GAMMA)) < sigmoid(z + shift)
    first_failure = np.argmin(np.concatenate([survives, np.zeros((num, 1), bool)], axis=1), axis=1)
    verified_len = rng.integers(1, GAMMA + 1, size=num)
    return z, np.minimum(first_failure, verified_len), verified_len


@pytest.mark.parametrize("shift", [-1.5, 0.0, 1.5])
def test_live_offset_learns_the_shift_of_a_verifiers_traffic(shift):
    offset = LiveOffset()
    z, accepted, verified = shifted_traffic(seed=3, shift=shift)
    for rows in np.array_split(np.arange(len(z)), 50):  # step reports of 4 requests
        offset.observe(z[rows], None, accepted[rows], verified[rows])
    assert abs(offset.value - shift) < 0.45, offset.value


def test_live_offset_follows_new_traffic_and_ignores_undecided_tokens():
    offset = LiveOffset(window=64)
    for seed, shift in ((4, 2.0), (5, -2.0)):
        z, accepted, verified = shifted_traffic(seed, shift)
        for rows in np.array_split(np.arange(len(z)), 50):
            offset.observe(z[rows], None, accepted[rows], verified[rows])
    assert offset.value < -1.3  # the window holds only the second traffic's blocks
    before = offset.value
    # Nothing verified (a probe's report) is no outcome; a sure block that accepted nothing pulls down.
    assert offset.observe(np.full((2, GAMMA), 9.0), None, [0, 0], [0, 0]) == before
    z = np.full((1, GAMMA), 9.0)
    assert LiveOffset().observe(z, None, [0], [GAMMA]) < -0.5 and LiveOffset().observe(z, None, [GAMMA], [GAMMA]) > 0


def test_live_offset_makes_the_promised_sum_what_was_accepted():
    """The budget spends the sum of survivals: after the fit the window's blocks promise the draft
    tokens they accepted (up to the shrinkage towards 0)."""
    z, accepted, verified = shifted_traffic(seed=8, shift=-1.0, num=64)
    offset = LiveOffset(window=64, prior_blocks=0.0)
    offset.observe(z * 2.0, None, accepted, verified)  # over-confident logits on top of the shift
    assert offset.promised(offset.value) == pytest.approx(accepted.sum(), rel=1e-3)
    assert offset.promised(0.0) > 1.3 * accepted.sum()  # what the raw confidences promised
