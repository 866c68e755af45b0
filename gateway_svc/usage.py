"""Usage accounting of one HTTP request from the SDK's chunks: token counts and what speculation did."""
from __future__ import annotations

from dataclasses import dataclass

from dspark_client import Chunk, SpecMetrics


@dataclass
class ChoiceTotals:
    """Running totals of one choice (one upstream generation)."""

    prompt_index: int
    tokens: int = 0                     # completion tokens streamed so far
    metrics: SpecMetrics | None = None  # the last counters the server sent (totals on the last chunk)

    def add(self, chunk: Chunk) -> None:
        self.tokens += len(chunk.token_ids)
        self.metrics = chunk.metrics or self.metrics


def usage(choices: list[ChoiceTotals]) -> dict:
    """OpenAI's usage block plus our `speculation` figures, summed over the choices.

    A prompt counts once however many choices answer it (as OpenAI counts n > 1). tau is the
    acceptance length over all choices: tokens per target pass, the bonus token included."""
    prompts: dict[int, int] = {}
    steps = drafts = draft_tokens = accepted = 0
    for c in choices:
        m = c.metrics
        if m is None:
            continue
        prompts[c.prompt_index] = m.prompt_tokens
        steps += m.steps
        drafts += m.drafts
        draft_tokens += m.draft_tokens
        accepted += m.accepted_tokens
    prompt_tokens = sum(prompts.values())
    completion_tokens = sum(c.tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "speculation": {
            "drafts": drafts,                    # target passes that verified at least one draft token
            "draft_tokens": draft_tokens,        # draft tokens verified
            "accepted_tokens": accepted,         # of those, accepted
            "tau": round(completion_tokens / steps, 4) if steps else 0.0,
        },
    }
