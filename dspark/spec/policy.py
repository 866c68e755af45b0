"""How many draft tokens each request verifies this step, and whether to draft at all.

The speculative loop asks a policy, before drafting, whether this step drafts (`should_draft`:
a step that would verify nothing should not pay for a draft), then, after drafting, for
per-request lengths. FixedK is the baseline; the confidence scheduler (two-step rule) plugs in
through the same two methods. A policy sees the drafts' confidences, never the draft tokens'
target probabilities, so it cannot bias the output.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FixedK:
    k: int

    def should_draft(self, num_requests: int) -> bool:
        return self.k > 0

    def lengths(self, block, caps: list[int]) -> list[int]:
        """block: the DraftBlock (unused here); caps: per-request upper bounds (room, overrides)."""
        return [max(0, min(self.k, c)) for c in caps]


@dataclass
class NoSpeculation:
    def should_draft(self, num_requests: int) -> bool:
        return False

    def lengths(self, block, caps: list[int]) -> list[int]:
        return [0] * len(caps)
