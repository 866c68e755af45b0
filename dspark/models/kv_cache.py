"""Slot KV cache: one contiguous row per running sequence, so rollback is just a shorter length.

Continuous batching allocates a free slot when a sequence starts and frees it when it ends.
Rejected draft positions are rolled back by lowering the slot's length: their keys/values stay
in memory but are never attended to and are overwritten by the next pass.

A freed slot also keeps the keys/values of the tokens its sequence had decided (`free(slot, held)`):
a new sequence whose prompt starts with those tokens takes that slot and skips computing them
(`allocate_reusing`), a shared system prompt or the earlier turns of a conversation. A row's keys and
values are the same bits whatever pass computed them (the kernels are batch invariant: the same
property that makes a verified draft row equal to decoding it), so reuse changes no output.
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
        self._free = list(range(max_slots - 1, -1, -1))  # the next to go last; freed slots go after it
        self._held: dict[int, list[int]] = {}  # free slot -> tokens whose keys/values it still holds

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
        self._held.pop(slot, None)  # whoever takes it writes over what it held
        self.lengths[slot] = 0
        return slot

    def allocate_reusing(self, tokens: list[int], limit: int) -> tuple[int, int, int | None]:
        """A free slot for a sequence of `tokens`: (slot, n, source), the slot holding the first n of
        them (n <= limit), copied from the free slot `source` that held the longest such prefix (None:
        n = 0). A source whose whole content is that prefix is taken itself; otherwise the prefix is
        copied into another slot (one that holds nothing, else the one freed longest ago) so that a
        longer history it holds, a conversation's earlier turns, stays for the request that resumes it."""
        if not self._free:
            raise RuntimeError("KV cache full: no free slot")
        source, reused = None, 0
        for slot in self._free:
            held = self._held.get(slot)
            if held and held[0] == tokens[0]:
                n = _common_prefix(held, tokens, limit)
                if n > reused:
                    source, reused = slot, n
        if source is not None and reused == len(self._held[source]):
            slot = source
        else:
            slot = next((slot for slot in reversed(self._free) if slot not in self._held), self._free[0])
        self._free.remove(slot)
        self._held.pop(slot, None)
        if reused and slot != source:
            for layer in self.k + self.v:
                layer[slot, :, :reused] = layer[source, :, :reused]
        self.lengths[slot] = reused
        return slot, reused, source

    def free(self, slot: int, held: list[int] | None = None) -> None:
        """held: the tokens whose keys/values the slot holds from position 0 (kept as given, for a later
        sequence that starts with them), or None."""
        self.lengths[slot] = 0
        self._free.append(slot)
        if held:
            self._held[slot] = held

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


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most limit: a binary search over slice compares
    (each one in C), not a token-by-token loop in Python."""
    lo, hi = 0, min(len(a), len(b), limit)
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
