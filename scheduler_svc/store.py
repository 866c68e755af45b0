"""Where the scheduler's shared state lives: Redis (RedisStore) or this process (MemoryStore).

One interface, so local mode runs without Redis. Keys in Redis:
  dspark:verifier:<id>         JSON record of a verifier (address, model, load, heartbeat), with a TTL
  dspark:verifiers             set of verifier ids (index; entries whose record expired are dropped)
  dspark:queue:pending         list of request ids waiting for a verifier (the autoscaler reads its length)
  dspark:calibration:<version> hash of verify-outcome counters per drafter version (placeholder for online STS)
Every call may raise when Redis is down; the scheduler catches that and serves from its last view.
"""
from __future__ import annotations

import json
import time

import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

PENDING = "dspark:queue:pending"
VERIFIERS = "dspark:verifiers"


def verifier_key(verifier_id: str) -> str:
    return f"dspark:verifier:{verifier_id}"


def calibration_key(drafter_version: str) -> str:
    return f"dspark:calibration:{drafter_version}"


class MemoryStore:
    def __init__(self):
        self._verifiers: dict[str, tuple[float, dict]] = {}  # id -> (expires at, record)
        self._pending: list[str] = []
        self._calibration: dict[str, dict[str, int]] = {}

    async def put_verifier(self, verifier_id: str, record: dict, ttl_s: float) -> None:
        self._verifiers[verifier_id] = (time.monotonic() + ttl_s, dict(record))

    async def verifiers(self) -> dict[str, dict]:
        now = time.monotonic()
        self._verifiers = {k: v for k, v in self._verifiers.items() if v[0] > now}
        return {k: dict(v[1]) for k, v in self._verifiers.items()}

    async def push_pending(self, request_id: str) -> None:
        self._pending.append(request_id)

    async def remove_pending(self, request_id: str) -> None:
        if request_id in self._pending:
            self._pending.remove(request_id)

    async def pending_len(self) -> int:
        return len(self._pending)

    async def add_outcomes(self, drafter_version: str, counts: dict[str, int]) -> None:
        stats = self._calibration.setdefault(drafter_version, {})
        for name, n in counts.items():
            stats[name] = stats.get(name, 0) + n

    async def calibration(self, drafter_version: str) -> dict[str, int]:
        return dict(self._calibration.get(drafter_version, {}))

    async def close(self) -> None:
        pass


class RedisStore:
    def __init__(self, url: str, timeout_s: float = 0.5, max_connections: int = 32):
        # No retries inside redis-py: a dead Redis must fail fast, the scheduler has its own fallback.
        # One bounded pool for every call of this replica; a burst waits for a free connection
        # (up to timeout_s) instead of opening connections until Redis or redis-py refuses.
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout_s, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0), decode_responses=True)
        self.redis = aioredis.Redis(connection_pool=pool)

    async def put_verifier(self, verifier_id: str, record: dict, ttl_s: float) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(verifier_key(verifier_id), json.dumps(record), px=int(ttl_s * 1000))
            pipe.sadd(VERIFIERS, verifier_id)
            await pipe.execute()

    async def verifiers(self) -> dict[str, dict]:
        ids = sorted(await self.redis.smembers(VERIFIERS))
        if not ids:
            return {}
        records = await self.redis.mget([verifier_key(i) for i in ids])
        gone = [i for i, r in zip(ids, records) if r is None]
        if gone:
            await self.redis.srem(VERIFIERS, *gone)
        return {i: json.loads(r) for i, r in zip(ids, records) if r is not None}

    async def push_pending(self, request_id: str) -> None:
        await self.redis.rpush(PENDING, request_id)

    async def remove_pending(self, request_id: str) -> None:
        await self.redis.lrem(PENDING, 0, request_id)

    async def pending_len(self) -> int:
        return int(await self.redis.llen(PENDING))

    async def add_outcomes(self, drafter_version: str, counts: dict[str, int]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for name, n in counts.items():
                pipe.hincrby(calibration_key(drafter_version), name, n)
            await pipe.execute()

    async def calibration(self, drafter_version: str) -> dict[str, int]:
        return {k: int(v) for k, v in (await self.redis.hgetall(calibration_key(drafter_version))).items()}

    async def close(self) -> None:
        await self.redis.aclose()
        await self.redis.connection_pool.disconnect()


def make_store(redis_url: str, max_connections: int = 32):
    return RedisStore(redis_url, max_connections=max_connections) if redis_url else MemoryStore()
