"""A flattened varlen batch: each sequence contributes any number of new tokens.

The new tokens of sequence b sit at positions [start_b, start_b + n_b) of its KV slot and attend
causally to everything before them in that slot only.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from dspark.device import host_values


@dataclass
class VarlenBatch:
    tokens: torch.Tensor  # [N] int64, all sequences' new tokens back to back
    positions: torch.Tensor  # [N] int64 absolute position of each new token
    slot_list: list[int]  # [B] KV slot per sequence (ignored without a cache)
    starts: list[int]  # [B] first new position per sequence (= cached length before this pass)
    lens: list[int]  # [B] new tokens per sequence

    @staticmethod
    def build(token_lists: list[list[int]], starts: list[int], slots: list[int] | None = None,
              device="cpu") -> VarlenBatch:
        lens = [len(t) for t in token_lists]
        if any(n == 0 for n in lens):
            raise ValueError("every sequence in a batch needs at least one new token")
        flat = [int(t) for seq in token_lists for t in seq]
        pos = [s + i for s, n in zip(starts, lens) for i in range(n)]
        device = torch.device(device)
        return VarlenBatch(
            tokens=host_values(flat, torch.long, device),
            positions=host_values(pos, torch.long, device),
            slot_list=list(slots) if slots is not None else list(range(len(lens))),
            starts=list(starts), lens=lens,
        )

    def to(self, device) -> VarlenBatch:
        """The same batch with its tensors on `device` (itself when already there)."""
        if self.tokens.device == torch.device(device):
            return self
        return VarlenBatch(self.tokens.to(device), self.positions.to(device), self.slot_list, self.starts, self.lens)

    def last_rows(self) -> torch.Tensor:
        """Flat row of each sequence's last new token (where next-token logits come from)."""
        return host_values([end - 1 for end in itertools.accumulate(self.lens)], torch.long, self.tokens.device)

    def seq_rows(self, b: int) -> slice:
        first = sum(self.lens[:b])
        return slice(first, first + self.lens[b])
