"""Slot KV cache: one contiguous row per running sequence, so rollback is just a shorter length.

Continuous batching allocates a free slot when a sequence starts and frees it when it ends.
Rejected draft positions are rolled back by lowering the slot's length: their keys/values stay
in memory but are never attended to and are overwritten by the next pass.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, max_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype=torch.float32, device="cpu"):
        shape = (max_slots, num_kv_heads, max_len, head_dim)  # heads first: a slot's prefix is an SDPA-ready view
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * max_slots
        self.max_len = max_len
        self._free = list(range(max_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def max_slots(self) -> int:
        return len(self.lengths)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("KV cache full: no free slot")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0
        self._free.append(slot)

    def advance(self, slot: int, length: int) -> None:
        """A pass wrote the slot's keys/values up to position `length`: it holds that many now."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"slot length {length} outside [0, {self.max_len}]")
        self.lengths[slot] = length

    def rollback(self, slot: int, length: int) -> None:
        """Forget every position >= length (rejected drafts)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"rollback to {length} outside [0, {self.lengths[slot]}]")
        self.lengths[slot] = length

    def usage(self) -> float:
        """Fraction of token capacity in use (for load reports)."""
        return sum(self.lengths) / (self.max_slots * self.max_len)
