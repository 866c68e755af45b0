"""Scores of the online calibration statistics (the scheduler's histograms, no raw samples).

`OnlineCalibrationStats` keeps, per block position k, a histogram of the raw logit z_k over the
blocks where token k's own outcome was decided (tokens 1..k-1 accepted, k verified) and how many
of them were accepted. From that alone one can score the per-token factor c_k = sigmoid(z_k / T_k)
against P(token k survives | its prefix survived): ECE over 20 equal-width bins of the predicted
probability, each logit bin weighted by its count. This is what the scheduler exports as
dspark_calibration_ece{position}; it is not the prefix-survival ECE of method.md 4 (that needs
the joint of z_1..z_k, which the histograms do not keep), but both go to 0 together when the
factors are calibrated.
"""
from __future__ import annotations

import numpy as np

from dspark.sched.calibration import OnlineCalibrationStats, sigmoid
from dspark.sched.metrics import ece


def position_ece(stats: OnlineCalibrationStats, temperatures=None, bins: int = 20) -> np.ndarray:
    """[gamma] ECE of sigmoid(z_k / T_k) against the observed acceptance per logit bin; NaN where
    a position has no decided sample. temperatures=None scores the raw confidences (T = 1)."""
    temperatures = np.ones(stats.gamma) if temperatures is None else np.asarray(temperatures, dtype=np.float64)
    out = np.full(stats.gamma, np.nan)
    for k in range(stats.gamma):
        used = stats.reached[k] > 0
        if used.any():
            count = stats.reached[k, used]
            rate = stats.accepted[k, used] / count
            out[k] = ece(sigmoid(stats.bin_centres[used] / temperatures[k]), rate, bins, weights=count)
    return out
