"""Tokens from logits, each row with its own sequence's sampling settings and generator."""
from __future__ import annotations

import torch

from dspark.device import host_values
from dspark.engine.sequence import Sequence
from dspark.sampling import logits_to_probs, sample_from_probs


def row_probs(logits: torch.Tensor, seqs: list[Sequence], rows_per_seq: list[int] | None = None) -> torch.Tensor:
    """Probabilities of each logits row under its sequence's temperature / top-k / top-p; sequence i
    owns rows_per_seq[i] consecutive rows (default: one each)."""
    counts = rows_per_seq or [1] * len(seqs)

    def per_row(values, dtype):
        return host_values([v for v, n in zip(values, counts) for _ in range(n)], dtype, logits.device)

    return logits_to_probs(logits, per_row([s.params.temperature for s in seqs], torch.float32),
                           per_row([s.params.top_k for s in seqs], torch.long),
                           per_row([s.params.top_p for s in seqs], torch.float32))


def sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row with each sequence's own parameters and generator."""
    if all(s.params.temperature <= 0 for s in seqs):  # all greedy: the argmax, without the vocabulary-wide
        return logits.argmax(dim=-1).tolist()           # softmax, one-hot and draw (the same tokens)
    return sample_from_probs(row_probs(logits, seqs), [s.generator for s in seqs]).tolist()  # one copy to the host
