"""Speculative-decoding counters, named like vLLM's (drafts, draft tokens, accepted tokens, per position)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    steps: int = 0  # target passes this request took part in after its prefill
    drafts: int = 0  # passes that verified at least one draft token
    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # tokens produced by those passes (accepted + corrected/bonus)
    accepted_per_pos: list[int] = field(default_factory=list)
    verified_per_pos: list[int] = field(default_factory=list)
    reached_per_pos: list[int] = field(default_factory=list)  # verified with every earlier token accepted

    def record(self, verified: int, accepted: int, emitted: int) -> None:
        self.steps += 1
        self.emitted_tokens += emitted
        if verified == 0:
            return
        self.drafts += 1
        self.draft_tokens += verified
        self.accepted_tokens += accepted
        need = verified - len(self.verified_per_pos)
        if need > 0:
            for counts in (self.verified_per_pos, self.accepted_per_pos, self.reached_per_pos):
                counts += [0] * need
        for j in range(verified):
            self.verified_per_pos[j] += 1
            self.accepted_per_pos[j] += j < accepted
            self.reached_per_pos[j] += j <= accepted

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per verified draft, bonus token counted (tau, as vLLM and the paper report it)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    def merge(self, other: SpecMetrics) -> SpecMetrics:
        out = SpecMetrics(self.steps + other.steps, self.drafts + other.drafts,
                          self.draft_tokens + other.draft_tokens, self.accepted_tokens + other.accepted_tokens,
                          self.emitted_tokens + other.emitted_tokens)
        n = max(len(self.verified_per_pos), len(other.verified_per_pos))
        pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
        for name in ("verified_per_pos", "accepted_per_pos", "reached_per_pos"):
            setattr(out, name, [a + b for a, b in zip(pad(getattr(self, name)), pad(getattr(other, name)))])
        return out

    def conditional_acceptance(self) -> list[float]:
        """P(token j accepted | tokens < j accepted and j verified), per position."""
        return [acc / reached if reached else float("nan")
                for acc, reached in zip(self.accepted_per_pos, self.reached_per_pos)]
