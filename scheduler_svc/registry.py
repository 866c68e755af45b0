"""The scheduler's view of its verifiers, and the routing rule (lowest load among live ones).

Records come from two places: heartbeats this scheduler receives (written through to the
store) and the store itself (heartbeats other scheduler replicas received). The last view is
kept in memory, so when the store is down routing goes on with it; heartbeats keep it fresh.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

log = logging.getLogger(__name__)


def load_of(record: dict, inflight: int, finished: int = 0) -> int:
    """Requests on a verifier: what it reported less those of ours that finished since, or what we
    have on it now, whichever is more. Without the first part a slot freed just after a report stayed
    taken until the next one (every 0.5 s): at 16 requests a round, the next round's requests queued
    here for up to that long while the verifier idled."""
    return max(int(record.get("running", 0)) + int(record.get("queued", 0)) - finished, inflight)


def choose(records: list[dict], inflight: dict[str, int], finished: dict[str, int] | None = None) -> str | None:
    """Address of the least loaded verifier with room, or None when all are full (or none is live).
    finished: per address, our requests that ended there since its record was reported."""
    best, best_key = None, None
    finished = finished or {}
    for r in records:
        address = r["address"]
        load, cap = load_of(r, inflight.get(address, 0), finished.get(address, 0)), int(r.get("max_batch", 0))
        if cap and load >= cap:
            continue
        key = (load / cap if cap else load, load, address)
        if best_key is None or key < best_key:
            best, best_key = address, key
    return best


class Registry:
    def __init__(self, store, ttl_s: float = 3.0, dead_s: float = 3.0):
        self.store, self.ttl_s, self.dead_s = store, ttl_s, dead_s
        self.records: dict[str, dict] = {}  # verifier id -> record (heartbeat = wall-clock seconds)
        self.discovered: list[str] | None = None  # addresses from discovery; None = any registered
        self.inflight: dict[str, int] = defaultdict(int)  # address -> our requests on it now
        self.finished: dict[str, int] = defaultdict(int)  # address -> ours that ended since its record
        self._dead_until: dict[str, float] = {}
        self.store_ok = True
        self._tasks: set[asyncio.Task] = set()

    # ---- writes ----------------------------------------------------------------------------
    def heartbeat(self, record: dict) -> None:
        record = dict(record, heartbeat=time.time())
        self.records[record["verifier_id"]] = record
        self.finished.pop(record.get("address"), None)  # the new record counts them already
        self.background(self.store.put_verifier(record["verifier_id"], record, self.ttl_s))

    def mark_dead(self, address: str) -> None:
        """A stream to it broke: route nothing there for a while (its heartbeats may still look fresh)."""
        self._dead_until[address] = time.monotonic() + self.dead_s

    def revive(self, address: str) -> None:
        self._dead_until.pop(address, None)

    def background(self, coro, after: asyncio.Task | None = None) -> asyncio.Task:
        """Run a store call without making the caller wait; failures only flip store_ok.

        `after`: a store call this one must follow (an undo issued before its do would be lost)."""
        task = asyncio.get_running_loop().create_task(self._guard(coro, after))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _guard(self, coro, after: asyncio.Task | None = None):
        if after is not None:
            await after  # never raises: it is a _guard too
        try:
            result = await asyncio.wait_for(coro, 1.0)
            self._set_store_ok(True)
            return result
        except Exception as error:  # Redis down or slow: keep serving from memory
            self._set_store_ok(False, error)
            return None

    def _set_store_ok(self, ok: bool, error=None) -> None:
        if ok != self.store_ok:
            if ok:
                log.info("store reachable again")
            else:
                log.warning("store unreachable (%s); serving from the last known state", error)
        self.store_ok = ok

    async def refresh(self) -> None:
        """Merge the store's records (newer heartbeat wins)."""
        fresh = await self._guard(self.store.verifiers())
        for vid, rec in (fresh or {}).items():
            if rec.get("heartbeat", 0) > self.records.get(vid, {}).get("heartbeat", 0):
                self.records[vid] = rec
                self.finished.pop(rec.get("address"), None)
        cutoff = time.time() - 10 * self.ttl_s
        self.records = {k: r for k, r in self.records.items() if r.get("heartbeat", 0) > cutoff}

    # ---- reads -----------------------------------------------------------------------------
    def live(self) -> list[dict]:
        now, mono = time.time(), time.monotonic()
        out = []
        for r in self.records.values():
            addr = r.get("address")
            if not addr or now - r.get("heartbeat", 0) > self.ttl_s or self._dead_until.get(addr, 0) > mono:
                continue
            if self.discovered is not None and addr not in self.discovered:
                continue
            out.append(r)
        return out

    def is_live(self, record: dict) -> bool:
        """Heartbeat fresh (whether or not a broken stream marked it dead for a while)."""
        return time.time() - record.get("heartbeat", 0) <= self.ttl_s

    def choose(self) -> str | None:
        return choose(self.live(), self.inflight, self.finished)

    def finish(self, address: str) -> None:
        """One of our requests on this verifier ended: its slot is free before the next report says so."""
        self.inflight[address] -= 1
        self.finished[address] += 1

    def models(self) -> set[str]:
        return {r["model"] for r in self.live() if r.get("model")}

    def by_id(self, verifier_id: str) -> dict | None:
        return self.records.get(verifier_id)
