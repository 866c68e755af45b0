"""Online STS in the scheduler (method.md 4, 6): labels from step reports -> temperatures.

Each ReportStep's raw confidence logits with its verified/accepted lengths is binned into an
in-memory delta per drafter version (cheap, on the request path). A background loop, off every
request's path, every `flush_s`:
  1. adds the deltas to the store (Redis: HINCRBY, see calibration_store.py),
  2. refits when due (`refit_reports` reports since this replica's last fit, or `refit_s`
     seconds with new reports), from the *accumulated* statistics of all replicas, once
     position 1 has `min_samples` decided outcomes (a later position with fewer keeps the
     drafter's shipped temperature, `priors`); stores temperatures + a new version,
  3. picks up newer fits other replicas stored.
Replies (BudgetDecision.calibration) carry the newest fit known here; verifiers apply it when its
version is newer than theirs. The same temperatures calibrate the survivals the two-step rule uses.
"""
from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from dspark.proto_gen.v1 import load_pb2, tensor_pb2
from dspark.sched.calibration import OnlineCalibrationStats
from dspark.sched.online import position_ece
from dspark.serving import metrics
from scheduler_svc.calibration_store import Fit, LayoutMismatch

log = logging.getLogger(__name__)


class OnlineCalibrator:
    def __init__(self, store, refit_reports: int = 500, refit_s: float = 30.0, min_samples: int = 200,
                 flush_s: float = 0.5):
        self.store = store
        self.refit_reports, self.refit_s, self.min_samples, self.flush_s = refit_reports, refit_s, min_samples, flush_s
        self.priors: dict[str, np.ndarray] = {}  # drafter version -> its shipped STS temperatures
        self._delta: dict[str, OnlineCalibrationStats] = {}
        self._delta_reports: dict[str, int] = {}
        # Reports this replica flushed to the store since its last refit. Counted at the flush, not on
        # arrival: a report that lands while a tick awaits the store stays in the next delta, and
        # counting it on arrival let the refit after that flush reset the count without it in the
        # store, so the fit missed it until some later report came (a test's final refit never did).
        self._since_fit: dict[str, int] = {}
        self._last_fit_at: dict[str, float] = {}
        self.fits: dict[str, Fit] = {}  # newest fit known here, per drafter version
        self._refused: set[str] = set()

    # ---- request path ----------------------------------------------------------------------
    def add(self, drafter_version: str, conf_logits: np.ndarray, accepted_len, verified_len, reports: int = 1) -> None:
        """The rows of `reports` step reports: conf_logits [R, gamma] raw, lengths [R]."""
        gamma = conf_logits.shape[1]
        delta = self._delta.get(drafter_version)
        if delta is None or delta.gamma != gamma:
            delta = self._delta[drafter_version] = OnlineCalibrationStats(gamma)
            self._delta_reports[drafter_version] = 0
        delta.add(conf_logits, np.asarray(accepted_len), np.asarray(verified_len))
        self._delta_reports[drafter_version] += reports
        metrics.CALIBRATION_REPORTS.inc(reports)

    def calibration(self, drafter_version: str) -> load_pb2.Calibration | None:
        fit = self.fits.get(drafter_version)
        if fit is None:
            return None
        temps = fit.temperatures.astype("<f4")
        return load_pb2.Calibration(drafter_version=drafter_version, version=fit.version,
                                    temperatures=tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_F32, shape=[temps.size],
                                                                   data=temps.tobytes()))

    # ---- background ------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # Redis down: keep the deltas, try again next tick
                log.warning("online calibration: %s", error)
            await asyncio.sleep(self.flush_s)

    async def tick(self) -> None:
        await self.flush()
        for version in list(self._since_fit):
            if self._due(version):
                await self.refit(version)
        for version in list(self._since_fit) + [v for v in self.fits if v not in self._since_fit]:
            stored = await self.store.fit(version)
            if stored is not None and stored.version > getattr(self.fits.get(version), "version", 0):
                self._use(version, stored)

    async def flush(self) -> None:
        for version in list(self._delta):
            delta, reports = self._delta.pop(version), self._delta_reports.pop(version)
            try:
                await self.store.add(version, delta, reports)
                self._since_fit[version] = self._since_fit.get(version, 0) + reports
            except LayoutMismatch as error:
                if version not in self._refused:
                    log.error("dropping calibration reports: %s", error)
                    self._refused.add(version)
            except Exception:
                # Not written (one MULTI/EXEC): put it back for the next tick.
                have = self._delta.get(version)
                self._delta[version] = delta if have is None or have.gamma != delta.gamma else have.merge(delta)
                self._delta_reports[version] = self._delta_reports.get(version, 0) + reports
                raise

    def _due(self, version: str) -> bool:
        new = self._since_fit.get(version, 0)
        if new == 0:
            return False
        waited = time.monotonic() - self._last_fit_at.get(version, 0.0)
        return new >= self.refit_reports or waited >= self.refit_s

    async def refit(self, version: str) -> Fit | None:
        stats = await self.store.stats(version)
        self._since_fit[version] = 0
        if stats is None or stats.num_samples[0] < self.min_samples:
            return None  # not enough labels yet: try again as soon as more reports come
        self._last_fit_at[version] = time.monotonic()
        temperatures = await asyncio.to_thread(stats.fit, min_samples=self.min_samples, prior=self.priors.get(version))
        fit = Fit(0, temperatures, stats.num_samples, position_ece(stats, temperatures), time.time())
        if not await self.store.save_fit(version, fit):
            return None  # another replica stored a fit of newer data: tick() picks it up
        log.info("STS refit of %s: v%d, T=%s, ECE per position=%s (raw %s), samples=%s", version, fit.version,
                 np.round(temperatures, 3).tolist(), np.round(fit.ece, 4).tolist(),
                 np.round(position_ece(stats), 4).tolist(), fit.samples.tolist())
        self._use(version, fit)
        return fit

    def _use(self, version: str, fit: Fit) -> None:
        self.fits[version] = fit
        metrics.CALIBRATION_VERSION.labels(version).set(fit.version)
        for k, e in enumerate(fit.ece):
            if not np.isnan(e):
                metrics.CALIBRATION_ECE.labels(str(k + 1)).set(float(e))
