"""SPS table: target steps per second as a function of the batch-token count B.

The scheduler maximises Theta = tau * SPS(B), so it needs SPS at any B. The table keeps
the measured step time per exact B (the real, jagged profile, which the two-step rule
searches over), keeps it current with an exponential moving average from live steps, and
answers for unmeasured B by interpolation.

Step *seconds* are stored and averaged, not rates: averaging rates of noisy samples is
biased towards fast outliers. SPS(B) = 1 / seconds(B).

Interpolation is "monotone-safe":
- between two measured B, seconds are interpolated linearly, so the answer always lies
  between its two neighbours (no invented peaks or dips);
- below the smallest measured B we answer that B's time: fewer tokens are never assumed
  to be faster than what was measured;
- above the largest measured B we assume the time per token stays what it was there
  (seconds grow proportionally to B), so SPS keeps falling and the scheduler is never
  lured into an unmeasured region by an optimistic guess.

A profile measured before serving (`set_profile`: short contexts, an idle host) gives the
shape of the curve but not its level under load: serving 16 long requests, a live step at
B = 16 took 3x its profile time, while B = 23, seen only when prompt lookup's drafts are
verified, kept its profile time, and interpolating between the two made 23 tokens look cheaper
than 16. So every B not yet observed live answers profile(B) x level, where level tracks the
live steps' seconds / profile(B).
"""

from __future__ import annotations

import bisect

import numpy as np


class SpsTable:
    def __init__(self, seconds_by_tokens: dict[int, float] | None = None, ema_weight: float = 0.1):
        if not 0.0 < ema_weight <= 1.0:
            raise ValueError(f"ema_weight must be in (0, 1], got {ema_weight}")
        self.ema_weight = ema_weight
        self.seconds_by_tokens: dict[int, float] = {}
        for tokens, seconds in (seconds_by_tokens or {}).items():
            self._check(tokens, seconds)
            self.seconds_by_tokens[int(tokens)] = float(seconds)
        self.profile: dict[int, float] = {}  # set_profile's points, as measured
        self.live: set[int] = set()  # B observed in live steps since the profile
        self.level = 1.0  # live seconds / profile seconds, an EMA over live steps
        # The table's and the profile's points sorted (_points), built when first asked for after a
        # change: the policy asks several times a step, and rebuilding them from the dicts took most
        # of the ~60 us an answer cost.
        self._table_points: tuple | None = None
        self._profile_points: tuple | None = None

    def set_profile(self, seconds_by_tokens: dict[int, float]) -> None:
        """Points measured before serving: their shape is kept, their level follows live steps."""
        for tokens, seconds in seconds_by_tokens.items():
            self._check(tokens, seconds)
        self.profile = {int(b): float(s) for b, s in seconds_by_tokens.items()}
        self.live, self.level = set(), 1.0
        self.seconds_by_tokens.update(self.profile)
        self._table_points, self._profile_points = None, _points(self.profile) if self.profile else None

    @staticmethod
    def _check(tokens, seconds) -> None:
        if int(tokens) < 1 or not float(seconds) > 0.0:
            raise ValueError(f"need tokens >= 1 and seconds > 0, got ({tokens}, {seconds})")

    @classmethod
    def from_sps(cls, sps_by_tokens: dict[int, float], ema_weight: float = 0.1) -> SpsTable:
        """Build from steps-per-second values, e.g. SpsTable.from_sps({1: 1.0, 2: 0.5})."""
        return cls({b: 1.0 / s for b, s in sps_by_tokens.items()}, ema_weight)

    @classmethod
    def from_samples(cls, token_counts, seconds, ema_weight: float = 0.1) -> SpsTable:
        """Build from profiling samples (B, step seconds); the median per B resists outliers."""
        token_counts = np.asarray(token_counts, dtype=np.int64)
        seconds = np.asarray(seconds, dtype=np.float64)
        table = {
            int(b): float(np.median(seconds[token_counts == b])) for b in np.unique(token_counts)
        }
        return cls(table, ema_weight)

    def observe(self, tokens: int, seconds: float) -> None:
        """Fold one live step into its bucket (a new B starts its own bucket), and the profile's
        points not observed live yet to the live level."""
        self._check(tokens, seconds)
        tokens = int(tokens)
        if self.profile:
            ratio = seconds / _interpolate(self._profile_points, tokens)
            self.level = ratio if not self.live else (1.0 - self.ema_weight) * self.level + self.ema_weight * ratio
            for b, profiled in self.profile.items():
                if b not in self.live:  # this step's B too, the first time: its bucket starts at the level
                    self.seconds_by_tokens[b] = profiled * self.level
            self.live.add(tokens)
        old = self.seconds_by_tokens.get(tokens)
        if old is None:
            self.seconds_by_tokens[tokens] = float(seconds)
        else:
            self.seconds_by_tokens[tokens] = (1.0 - self.ema_weight) * old + self.ema_weight * seconds
        self._table_points = None

    def seconds(self, tokens):
        """Step time at B tokens (scalar or array of B)."""
        if not self.seconds_by_tokens:
            raise ValueError("SPS table is empty")
        if self._table_points is None:
            self._table_points = _points(self.seconds_by_tokens)
        return _interpolate(self._table_points, tokens)

    def __call__(self, tokens):
        """SPS(B): steps per second at B tokens (scalar or array of B)."""
        return 1.0 / self.seconds(tokens)

    def to_dict(self) -> dict:
        """Plain JSON-ready data (keys are strings, as JSON needs)."""
        return {
            "ema_weight": self.ema_weight,
            "seconds_by_tokens": {str(b): s for b, s in sorted(self.seconds_by_tokens.items())},
        }

    @classmethod
    def from_dict(cls, data: dict) -> SpsTable:
        table = {int(b): float(s) for b, s in data["seconds_by_tokens"].items()}
        return cls(table, float(data.get("ema_weight", 0.1)))


def _points(seconds_by_tokens: dict[int, float]) -> tuple[list[float], list[float], np.ndarray, np.ndarray]:
    """The points, B ascending, as lists (for one B) and as arrays (for many)."""
    known_b = sorted(seconds_by_tokens)
    known_s = [float(seconds_by_tokens[b]) for b in known_b]
    return [float(b) for b in known_b], known_s, np.array(known_b, dtype=np.float64), np.array(known_s)


def _interpolate(points, tokens):
    """Seconds at B by the monotone-safe rules above (scalar or array of B), on _points' points. One B
    is answered in plain Python: numpy's calls on a few points took ~10x longer right after a target
    pass, and the engine asks after every step."""
    list_b, list_s, known_b, known_s = points
    if np.ndim(tokens) == 0:
        b = float(tokens)
        if b > list_b[-1]:
            return list_s[-1] * b / list_b[-1]
        i = bisect.bisect_left(list_b, b)
        if i == 0 or list_b[i] == b:
            return list_s[i]
        b0, b1, s0, s1 = list_b[i - 1], list_b[i], list_s[i - 1], list_s[i]
        return s0 + (s1 - s0) * (b - b0) / (b1 - b0)
    b = np.asarray(tokens, dtype=np.float64)
    inside = np.interp(b, known_b, known_s)  # np.interp clamps to the end values outside
    beyond = known_s[-1] * b / known_b[-1]
    return np.where(b > known_b[-1], beyond, inside)
