"""How many draft tokens each request verifies this step.

The speculative loop asks a policy for per-request lengths after drafting. FixedK is the
baseline; the confidence scheduler (two-step rule) plugs in through the same method. A policy
sees the drafts' confidences, never the draft tokens' target probabilities, so it cannot bias
the output.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FixedK:
    k: int

    def lengths(self, block, caps: list[int]) -> list[int]:
        """block: the DraftBlock (unused here); caps: per-request upper bounds (room, overrides)."""
        return [max(0, min(self.k, c)) for c in caps]


@dataclass
class NoSpeculation:
    def lengths(self, block, caps: list[int]) -> list[int]:
        return [0] * len(caps)


def conf_or_none(block) -> torch.Tensor | None:
    return None if block is None else block.conf_logits
