"""A parallel drafter's context: each layer's keys and values of the decided positions, per request.

Stored as the target's KV cache is, one slot per request and [slots, KV, capacity, hd] a layer, so
the CPU attention kernel reads a request's keys where they lie and a draft block writes its own
right after them (scratch positions, overwritten by the next context rows). Rollback is a shorter
length; slots and capacity grow by doubling, so appending a few positions a step copies nothing.
"""
from __future__ import annotations

import torch


class ContextKV:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int):
        self.shape = (kv_heads, head_dim)
        self.device = torch.device("cpu")  # until a first append says otherwise
        self.k: list[torch.Tensor] = []  # per layer [slots, KV, capacity, hd] float32
        self.v: list[torch.Tensor] = []
        self.num_layers, self.slots, self.capacity = num_layers, 0, 0
        self._slot: dict[str, int] = {}
        self._len: dict[str, int] = {}
        self._free: list[int] = []

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._slot

    def __len__(self) -> int:
        """How many requests hold a context."""
        return len(self._slot)

    def length(self, req_id: str) -> int:
        return self._len.get(req_id, 0)

    def slot(self, req_id: str) -> int:
        """The request's slot, taken (and the slots doubled when none is free) on first use."""
        if req_id not in self._slot:
            if not self._free:
                self._grow(max(4, 2 * self.slots), self.capacity)
            self._slot[req_id], self._len[req_id] = self._free.pop(), 0
        return self._slot[req_id]

    def reserve(self, positions: int) -> None:
        """Room for `positions` positions in every slot (a context plus the block drafted after it)."""
        if positions > self.capacity:
            self._grow(self.slots, max(64, 2 * positions))

    def append(self, req_id: str, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """kv: per layer (keys, values) [n, KV, hd] of the next n positions."""
        if not self.k:
            self.device = kv[0][0].device
        slot, start = self.slot(req_id), self.length(req_id)
        end = start + kv[0][0].shape[0]
        self.reserve(end)
        for layer, (k, v) in enumerate(kv):
            self.k[layer][slot, :, start:end] = k.transpose(0, 1)
            self.v[layer][slot, :, start:end] = v.transpose(0, 1)
        self._len[req_id] = end

    def claim(self, req_id: str, n: int) -> tuple[int, int]:
        """Room for the request's next n positions, counted as held: (slot, first position) for a caller
        that writes them into every layer itself (the CPU kernels' rope_cache_write)."""
        slot, start = self.slot(req_id), self.length(req_id)
        self.reserve(start + n)
        self._len[req_id] = start + n
        return slot, start

    def truncate(self, req_id: str, n: int) -> None:
        if n < 0 or n > self.length(req_id):
            raise ValueError(f"cannot keep {n} of {self.length(req_id)} context positions of {req_id!r}")
        if req_id in self._len:
            self._len[req_id] = n

    def release(self, req_id: str) -> None:
        slot = self._slot.pop(req_id, None)
        self._len.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def gather(self, req_ids: list[str]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Every layer's keys and values of several requests, right-padded to the longest context:
        ([(k, v) [R, KV, L, hd] per layer], valid [R, L] bool). One request's are views, no copy."""
        lengths = [self.length(r) for r in req_ids]
        longest, device = max(lengths, default=0), self.device
        valid = torch.arange(longest, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
        if not longest:
            empty = torch.zeros(len(req_ids), self.shape[0], 0, self.shape[1], device=device)
            return [(empty, empty)] * self.num_layers, valid
        if len(req_ids) == 1:
            pick = slice(self._slot[req_ids[0]], self._slot[req_ids[0]] + 1)
        else:
            pick = torch.tensor([self._slot.get(r, 0) for r in req_ids], device=device)
        return [(k[pick, :, :longest], v[pick, :, :longest]) for k, v in zip(self.k, self.v)], valid

    def _grow(self, slots: int, capacity: int) -> None:
        kv_heads, head_dim = self.shape
        for store in (self.k, self.v):
            if not store:
                store.extend(torch.zeros(0, kv_heads, 0, head_dim, device=self.device) for _ in range(self.num_layers))
            for layer, old in enumerate(store):
                grown = old.new_zeros((slots, kv_heads, capacity, head_dim))
                grown[:self.slots, :, :self.capacity] = old
                store[layer] = grown
        self._free.extend(range(slots - 1, self.slots - 1, -1))
        self.slots, self.capacity = slots, capacity
