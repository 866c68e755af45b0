"""Online-calibration state of the scheduler: STS statistics and fitted temperatures per drafter version.

Redis layout (one drafter version = one checkpoint; <v> is its version string):

  dspark:calibration:<v>:bins   hash, the accumulated OnlineCalibrationStats
      layout        JSON {"gamma", "bin_width", "logit_limit"}, set once (HSETNX); reports of
                    another layout are refused, never mixed in
      r:<k>:<bin>   decided outcomes at block position k (0-based) whose raw logit fell in <bin>
      a:<k>:<bin>   how many of them were accepted
      reports       step reports folded in
  dspark:calibration:<v>:sts    hash, the newest fit
      version       grows by one per refit (HINCRBY); 0/absent = not fitted, use T = 1
      temperatures  JSON [gamma] floats
      samples       JSON [gamma] decided outcomes per position the fit used
      ece           JSON [gamma] per-position ECE after the fit (position_ece; null = no data)
      fitted_at     unix seconds

Merge safety: every scheduler replica only *adds* its own counts with HINCRBY (inside
MULTI/EXEC, so one flush lands whole or not at all); counters commute, so replicas never lose
each other's data and the bins are exactly the sum of all reports (only bins that changed are
written). A refit reads the bins, fits, and writes temperatures + version in one WATCH/MULTI/EXEC that
gives way when the stored fit already used more samples (counters only grow, so more samples =
newer data) or changed meanwhile; everyone takes the highest version.
The older `dspark:calibration:<v>` hash (plain outcome counters, store.py) is separate.
"""
from __future__ import annotations

import json

import numpy as np
from redis.exceptions import WatchError

from dspark.sched.calibration import OnlineCalibrationStats


def bins_key(drafter_version: str) -> str:
    return f"dspark:calibration:{drafter_version}:bins"


def sts_key(drafter_version: str) -> str:
    return f"dspark:calibration:{drafter_version}:sts"


def layout_of(stats: OnlineCalibrationStats) -> dict:
    return {"gamma": stats.gamma, "bin_width": stats.bin_width, "logit_limit": stats.logit_limit}


class LayoutMismatch(ValueError):
    pass


class Fit:
    """A stored fit: version, temperatures [gamma], samples [gamma], ece [gamma] (NaN = no data)."""

    def __init__(self, version: int, temperatures, samples, ece, fitted_at: float = 0.0):
        self.version, self.fitted_at = int(version), float(fitted_at)
        self.temperatures = np.asarray(temperatures, dtype=np.float64)
        self.samples = np.asarray(samples, dtype=np.int64)
        self.ece = np.array([np.nan if e is None else e for e in ece], dtype=np.float64)

    def fields(self) -> dict:
        return {"temperatures": json.dumps(self.temperatures.tolist()), "samples": json.dumps(self.samples.tolist()),
                "ece": json.dumps([None if np.isnan(e) else float(e) for e in self.ece]),
                "fitted_at": repr(self.fitted_at)}

    @classmethod
    def from_fields(cls, fields: dict) -> Fit | None:
        if not fields or int(fields.get("version", 0)) <= 0 or "temperatures" not in fields:
            return None
        return cls(int(fields["version"]), json.loads(fields["temperatures"]), json.loads(fields["samples"]),
                   json.loads(fields["ece"]), float(fields.get("fitted_at", 0)))


class MemoryCalibrationStore:
    """Same interface in this process (local mode without Redis)."""

    def __init__(self):
        self._stats: dict[str, OnlineCalibrationStats] = {}
        self._reports: dict[str, int] = {}
        self._fits: dict[str, Fit] = {}

    async def add(self, drafter_version: str, delta: OnlineCalibrationStats, reports: int) -> None:
        have = self._stats.get(drafter_version)
        if have is not None and layout_of(have) != layout_of(delta):
            raise LayoutMismatch(f"calibration layout of {drafter_version} is {layout_of(have)}")
        self._stats[drafter_version] = delta if have is None else have.merge(delta)
        self._reports[drafter_version] = self._reports.get(drafter_version, 0) + reports

    async def stats(self, drafter_version: str) -> OnlineCalibrationStats | None:
        return self._stats.get(drafter_version)

    async def save_fit(self, drafter_version: str, fit: Fit) -> int:
        old = self._fits.get(drafter_version)
        if old is not None and old.samples.sum() > fit.samples.sum():
            return 0
        fit.version = (old.version if old else 0) + 1
        self._fits[drafter_version] = fit
        return fit.version

    async def fit(self, drafter_version: str) -> Fit | None:
        return self._fits.get(drafter_version)


class RedisCalibrationStore:
    def __init__(self, redis):
        self.redis = redis  # a redis.asyncio client with decode_responses=True

    async def add(self, drafter_version: str, delta: OnlineCalibrationStats, reports: int) -> None:
        key = bins_key(drafter_version)
        layout = json.dumps(layout_of(delta), sort_keys=True)
        await self.redis.hsetnx(key, "layout", layout)
        stored = await self.redis.hget(key, "layout")
        if stored != layout:
            raise LayoutMismatch(f"calibration layout of {drafter_version} is {stored}, reports have {layout}")
        async with self.redis.pipeline(transaction=True) as pipe:
            for name, counts in (("r", delta.reached), ("a", delta.accepted)):
                for k, b in zip(*np.nonzero(counts)):
                    pipe.hincrby(key, f"{name}:{k}:{b}", int(counts[k, b]))
            pipe.hincrby(key, "reports", reports)
            await pipe.execute()

    async def stats(self, drafter_version: str) -> OnlineCalibrationStats | None:
        fields = await self.redis.hgetall(bins_key(drafter_version))
        if "layout" not in fields:
            return None
        stats = OnlineCalibrationStats(**json.loads(fields["layout"]))
        arrays = {"r": stats.reached, "a": stats.accepted}
        for field, value in fields.items():
            name, _, rest = field.partition(":")
            if name in arrays and rest:
                k, b = rest.split(":")
                arrays[name][int(k), int(b)] = int(value)
        return stats

    async def save_fit(self, drafter_version: str, fit: Fit) -> int:
        """Store under a new version; 0 (not stored) when the stored fit already used more data."""
        key = sts_key(drafter_version)
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(key)
                stored = Fit.from_fields(await pipe.hgetall(key))
                if stored is not None and stored.samples.sum() > fit.samples.sum():
                    return 0
                pipe.multi()
                pipe.hincrby(key, "version", 1)
                pipe.hset(key, mapping=fit.fields())
                version, _ = await pipe.execute()
            except WatchError:  # another replica stored a fit meanwhile: theirs stands
                return 0
        fit.version = int(version)
        return fit.version

    async def fit(self, drafter_version: str) -> Fit | None:
        return Fit.from_fields(await self.redis.hgetall(sts_key(drafter_version)))


def make_calibration_store(store):
    """Next to the scheduler's main store: Redis when it uses Redis, else in this process."""
    redis = getattr(store, "redis", None)
    return RedisCalibrationStore(redis) if redis is not None else MemoryCalibrationStore()
