"""Calibration metrics for draft confidences: ECE, AUROC, per-position report, reliability plot.

Measured as the reference evaluator does (method.md 4), so numbers compare with the paper:
at block position k the prediction is the prefix survival prod_{i<=k} c_i, the label is
"draft tokens 1..k were all accepted", and only samples where position k was actually
verified count. ECE uses 20 equal-width bins; the mean ECE is weighted by sample count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def ece(pred, label, bins: int = 20, weights=None) -> float:
    """Expected calibration error over equal-width bins on [0, 1], bins weighted by count.

    `label` may be fractional (an observed rate) when `weights` carries the sample counts,
    which is how histogrammed statistics are scored.
    """
    pred = np.asarray(pred, dtype=np.float64).ravel()
    label = np.asarray(label, dtype=np.float64).ravel()
    weights = np.ones_like(pred) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    total = weights.sum()
    if total <= 0:
        return float("nan")
    bin_index = np.clip((pred * bins).astype(np.int64), 0, bins - 1)  # pred == 1 goes to the last bin
    pred_sum = np.bincount(bin_index, weights=weights * pred, minlength=bins)
    label_sum = np.bincount(bin_index, weights=weights * label, minlength=bins)
    # sum_b (n_b / N) * |mean label_b - mean pred_b| = sum_b |label_sum_b - pred_sum_b| / N
    return float(np.abs(label_sum - pred_sum).sum() / total)


def auroc(pred, label) -> float:
    """Area under the ROC curve from ranks (Mann-Whitney U); tied predictions share their
    average rank, i.e. count one half. NaN when only one class is present."""
    pred = np.asarray(pred, dtype=np.float64).ravel()
    label = np.asarray(label).ravel().astype(bool)
    num_pos = int(label.sum())
    num_neg = label.size - num_pos
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    order = np.argsort(pred, kind="stable")
    _, first, counts = np.unique(pred[order], return_index=True, return_counts=True)
    average_rank = first + (counts + 1) / 2.0  # 1-based mean rank of each tie group
    ranks = np.repeat(average_rank, counts)
    positive_rank_sum = ranks[label[order]].sum()
    return float((positive_rank_sum - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))


def prefix_survival_pairs(conf, accepted_len, verified_len=None):
    """Flatten a batch of blocks into (prediction, label, position k) triples, 1-based k.

    conf [N, gamma]: per-token confidences c_k (already calibrated, if calibrating).
    accepted_len [N]: how many leading draft tokens were accepted.
    verified_len [N]: how many draft tokens were verified (default: all gamma).
    """
    conf = np.asarray(conf, dtype=np.float64)
    num, gamma = conf.shape
    accepted_len = np.asarray(accepted_len).reshape(num)
    verified_len = np.full(num, gamma) if verified_len is None else np.asarray(verified_len).reshape(num)
    position = np.arange(1, gamma + 1)[None, :]
    survival = np.cumprod(conf, axis=1)
    label = accepted_len[:, None] >= position
    verified = verified_len[:, None] >= position
    positions = np.broadcast_to(position, conf.shape)
    return survival[verified], label[verified], positions[verified]


@dataclass
class PositionCalibration:
    ece: np.ndarray  # [gamma], NaN where a position has no samples
    auroc: np.ndarray  # [gamma], NaN where a position has only one class
    count: np.ndarray  # [gamma] samples per position
    mean_ece: float  # ECE averaged over positions, weighted by count


def per_position_calibration(conf, accepted_len, verified_len=None, bins: int = 20) -> PositionCalibration:
    pred, label, position = prefix_survival_pairs(conf, accepted_len, verified_len)
    gamma = np.asarray(conf).shape[1]
    eces, aurocs, counts = np.full(gamma, np.nan), np.full(gamma, np.nan), np.zeros(gamma, dtype=np.int64)
    for k in range(1, gamma + 1):
        here = position == k
        counts[k - 1] = here.sum()
        if counts[k - 1]:
            eces[k - 1] = ece(pred[here], label[here], bins)
            aurocs[k - 1] = auroc(pred[here], label[here])
    used = counts > 0
    mean = float(np.sum(eces[used] * counts[used]) / counts.sum()) if counts.sum() else float("nan")
    return PositionCalibration(eces, aurocs, counts, mean)


def plot_reliability(series: dict, path, bins: int = 20, title: str | None = None) -> None:
    """Reliability diagram: observed rate against mean prediction per bin, one line per series.

    series: {name: (pred, label)}, e.g. {"raw": ..., "STS": ...} from prefix_survival_pairs.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect")
    for name, (pred, label) in series.items():
        pred = np.asarray(pred, dtype=np.float64).ravel()
        label = np.asarray(label, dtype=np.float64).ravel()
        bin_index = np.clip((pred * bins).astype(np.int64), 0, bins - 1)
        count = np.bincount(bin_index, minlength=bins)
        used = count > 0
        mean_pred = np.bincount(bin_index, weights=pred, minlength=bins)[used] / count[used]
        rate = np.bincount(bin_index, weights=label, minlength=bins)[used] / count[used]
        ax.plot(mean_pred, rate, marker="o", markersize=3, label=f"{name} (ECE {100 * ece(pred, label, bins):.1f}%)")
    ax.set_xlabel("predicted prefix survival")
    ax.set_ylabel("observed survival")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
