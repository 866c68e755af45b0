"""Sequential temperature scaling (STS) of draft confidences (method.md 4).

Raw confidence logits are over-confident. STS fits one temperature per block position, left
to right: T_k minimises the ECE of the prefix survival prod_{i<=k} sigmoid(z_i / T_i) against
"draft tokens 1..k all accepted", with T_1..T_{k-1} already fixed. Only samples where position
k was actually verified are labels. A positive temperature never reorders one position's
confidences.

`OnlineCalibrationStats` is the streaming version the scheduler keeps (in Redis, as a dict).
"""

from __future__ import annotations

import numpy as np

from dspark.sched.metrics import ece

# Log-spaced so small and large corrections get the same relative resolution (about 2.3% per
# step); 1.0 is exactly on the grid (the middle point).
DEFAULT_TEMPERATURE_GRID = np.geomspace(0.1, 10.0, 201)


def sigmoid(x):
    # tanh form: no overflow warnings for large |x|.
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=np.float64)))


def apply_sts(conf_logits, temperatures, offset: float = 0.0) -> np.ndarray:
    """Calibrated per-token confidences c_k = sigmoid(z_k / T_k + b); [..., gamma] -> same shape."""
    return sigmoid(np.asarray(conf_logits, dtype=np.float64) / np.asarray(temperatures, dtype=np.float64) + offset)


def _best_temperature(score, grid) -> float:
    scores = np.array([score(t) for t in grid])
    return float(grid[int(np.argmin(scores))])


def fit_sts(conf_logits, accepted_len, verified_len=None, grid=DEFAULT_TEMPERATURE_GRID, bins: int = 20) -> np.ndarray:
    """Fit temperatures [gamma] on offline data.

    conf_logits [N, gamma]: raw confidence logits of N draft blocks.
    accepted_len [N]: number of leading draft tokens accepted.
    verified_len [N]: number of draft tokens that were verified (default: all).
    A position with no verified sample keeps T = 1.
    """
    logits = np.asarray(conf_logits, dtype=np.float64)
    num, gamma = logits.shape
    accepted_len = np.asarray(accepted_len).reshape(num)
    verified_len = np.full(num, gamma) if verified_len is None else np.asarray(verified_len).reshape(num)
    grid = np.asarray(grid, dtype=np.float64)
    temperatures = np.ones(gamma)
    survival_before = np.ones(num)  # prod_{i<k} sigmoid(z_i / T_i) with the T already fitted
    for k in range(gamma):
        verified = verified_len > k
        if verified.any():
            before = survival_before[verified]
            z = logits[verified, k]
            label = accepted_len[verified] > k
            temperatures[k] = _best_temperature(
                lambda t, before=before, z=z, label=label: ece(before * sigmoid(z / t), label, bins), grid)
        survival_before = survival_before * sigmoid(logits[:, k] / temperatures[k])
    return temperatures


def decided_outcomes(accepted_len, verified_len, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """([N, gamma] bool, [N, gamma] bool): whether token k's own outcome was decided (tokens before
    it accepted, k verified) and whether it survived. Labels for c_k = P(k survives | 1..k-1 did)."""
    accepted_len = np.asarray(accepted_len).reshape(-1, 1)
    k = np.arange(gamma)[None, :]
    return (accepted_len >= k) & (np.asarray(verified_len).reshape(-1, 1) > k), accepted_len > k


class LiveOffset:
    """A logit offset b for one verifier's confidences, c_k = sigmoid(z_k / T_k + b), chosen so
    that the survivals promise what its last `window` verified blocks delivered:
    sum over blocks of sum_{j < verified} prod_{i <= j} c_i = sum of accepted draft tokens,
    the very sum the two-step rule spends. Shrunk towards 0 while few blocks are in.

    The STS temperatures are fitted on pooled traffic; how well a drafter does swings with what a
    verifier serves right now (one gsm8k prompt: 1.67 draft tokens accepted a step where the fitted
    survivals promised 0.5; a mix of four: 1.06 where they promised 2.3). A temperature cannot
    move a confidence across one half; this offset can. It sees only outcomes of earlier steps
    (verified drafts, or unverified ones checked since), never the drafts a budget admits.
    """

    def __init__(self, window: int = 64, prior_blocks: float = 8.0):
        self.window, self.prior_blocks = window, prior_blocks
        self._z = np.empty((0, 0))
        self._verified = np.empty(0, dtype=np.int64)
        self._accepted = np.empty(0, dtype=np.int64)
        self._in_verified = np.empty((0, 0), dtype=bool)  # [blocks, gamma]: position j < verified
        self.value = 0.0

    def promised(self, offset: float) -> float:
        """Draft tokens the window's blocks would be expected to accept at this offset."""
        return float(np.sum(np.cumprod(sigmoid(self._z + offset), axis=1), where=self._in_verified))

    def observe(self, conf_logits, temperatures, accepted_len, verified_len) -> float:
        """Add one report's blocks (raw logits [R, gamma] + lengths; unverified rows are skipped)."""
        z = np.asarray(conf_logits, dtype=np.float64)
        if temperatures is not None:
            z = z / np.asarray(temperatures, dtype=np.float64)
        verified = np.asarray(verified_len, dtype=np.int64).reshape(-1)
        rows = verified > 0
        if not rows.any():
            return self.value
        if self._z.shape[1] != z.shape[1]:
            self._z = np.empty((0, z.shape[1]))
        self._z = np.concatenate([self._z, z[rows]])[-self.window:]
        self._verified = np.concatenate([self._verified, verified[rows]])[-self.window:]
        self._accepted = np.concatenate([self._accepted, np.asarray(accepted_len).reshape(-1)[rows]])[-self.window:]
        self._in_verified = np.arange(z.shape[1])[None, :] < self._verified[:, None]
        target, low, high = float(self._accepted.sum()), -8.0, 8.0
        for _ in range(24):  # promised() rises with the offset: bisection to 1e-6
            mid = 0.5 * (low + high)
            low, high = (mid, high) if self.promised(mid) < target else (low, mid)
        blocks = len(self._verified)
        self.value = 0.5 * (low + high) * blocks / (blocks + self.prior_blocks)
        return self.value


class OnlineCalibrationStats:
    """Mergeable, serialisable statistics for refitting STS from live verification outcomes.

    Per block position k we keep a histogram of the raw logit z_k over the samples where token
    k's own outcome was decided (tokens 1..k-1 accepted and position k verified), with how many
    of them were accepted. Refitting chooses T_k so that sigmoid(bin centre / T_k) matches the
    observed acceptance rate per bin (ECE weighted by count): that is c_k's own meaning,
    P(token k survives | tokens before it survived), and calibrated factors make calibrated
    prefix survivals. Unlike the offline fit it cannot see the joint of z_1..z_k (that would
    not fit in a histogram), so it assumes each position's outcome given its prefix depends
    on its own logit; on the tests' traffic it lands within a fraction of an ECE point of the
    offline fit.

    Resolution: bins of width `bin_width` logits (default 1/16) on [-logit_limit, logit_limit]
    (default +-16, 512 bins); a logit is represented by its bin centre, off by at most 1/32,
    i.e. at most 0.008 in probability (the sigmoid's slope is at most 1/4). Logits outside the
    range fall into the end bins (their probabilities are within 1e-7 of 0 or 1 anyway).
    """

    def __init__(self, gamma: int, bin_width: float = 1.0 / 16, logit_limit: float = 16.0, reached=None, accepted=None):
        self.gamma = int(gamma)
        self.bin_width = float(bin_width)
        self.logit_limit = float(logit_limit)
        num_bins = int(round(2 * self.logit_limit / self.bin_width))
        shape = (self.gamma, num_bins)
        self.reached = np.zeros(shape, np.int64) if reached is None else np.asarray(reached, np.int64).reshape(shape)
        self.accepted = np.zeros(shape, np.int64) if accepted is None else np.asarray(accepted, np.int64).reshape(shape)

    @property
    def bin_centres(self) -> np.ndarray:
        num_bins = self.reached.shape[1]
        return -self.logit_limit + (np.arange(num_bins) + 0.5) * self.bin_width

    def add(self, conf_logits, accepted_len, verified_len=None) -> None:
        """Record one batch of verified blocks (same arguments as fit_sts)."""
        logits = np.asarray(conf_logits, dtype=np.float64).reshape(-1, self.gamma)
        num = logits.shape[0]
        accepted_len = np.asarray(accepted_len).reshape(num)
        verified_len = np.full(num, self.gamma) if verified_len is None else np.asarray(verified_len).reshape(num)
        num_bins = self.reached.shape[1]
        bin_index = np.floor((logits + self.logit_limit) / self.bin_width).astype(np.int64)
        bin_index = np.clip(bin_index, 0, num_bins - 1)
        decided, survived = decided_outcomes(accepted_len, verified_len, self.gamma)
        for k in range(self.gamma):
            self.reached[k] += np.bincount(bin_index[decided[:, k], k], minlength=num_bins)
            self.accepted[k] += np.bincount(bin_index[decided[:, k] & survived[:, k], k], minlength=num_bins)

    def _check_same_layout(self, other: OnlineCalibrationStats) -> None:
        if (self.gamma, self.bin_width, self.logit_limit) != (other.gamma, other.bin_width, other.logit_limit):
            raise ValueError("cannot merge calibration statistics with different layouts")

    def merge(self, other: OnlineCalibrationStats) -> OnlineCalibrationStats:
        """A new accumulator holding both (e.g. two scheduler replicas' statistics)."""
        self._check_same_layout(other)
        return OnlineCalibrationStats(
            self.gamma, self.bin_width, self.logit_limit, self.reached + other.reached, self.accepted + other.accepted
        )

    def fit(self, grid=DEFAULT_TEMPERATURE_GRID, bins: int = 20, min_samples: int = 1, prior=None) -> np.ndarray:
        """Temperatures [gamma]. A position with fewer than min_samples decided outcomes keeps its
        prior (the drafter's shipped temperature; T = 1 without one): later positions are reached
        rarely, and a temperature that minimises the ECE of a few dozen outcomes is noise (seen:
        T = 0.1 at positions 3-6 from 51-7 outcomes, which zeroed every survival past them)."""
        grid = np.asarray(grid, dtype=np.float64)
        temperatures = np.ones(self.gamma)
        if prior is not None and np.shape(prior) == (self.gamma,):
            temperatures = np.asarray(prior, dtype=np.float64).copy()
        for k in range(self.gamma):
            used = self.reached[k] > 0
            if self.reached[k].sum() < max(1, min_samples):
                continue
            centre = self.bin_centres[used]
            count = self.reached[k, used]
            rate = self.accepted[k, used] / count
            temperatures[k] = _best_temperature(
                lambda t, centre=centre, rate=rate, count=count: ece(sigmoid(centre / t), rate, bins, weights=count), grid)
        return temperatures

    @property
    def num_samples(self) -> np.ndarray:
        """[gamma] decided outcomes recorded per position."""
        return self.reached.sum(axis=1)

    def to_dict(self) -> dict:
        return {
            "gamma": self.gamma,
            "bin_width": self.bin_width,
            "logit_limit": self.logit_limit,
            "reached": self.reached.tolist(),
            "accepted": self.accepted.tolist(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> OnlineCalibrationStats:
        return cls(data["gamma"], data["bin_width"], data["logit_limit"], data["reached"], data["accepted"])
