"""One varlen target pass over pieces of several sequences: each sequence's new tokens after what
its KV slot already holds, flattened into one batch on the model's device."""
from __future__ import annotations

import torch

from dspark.device import host_values
from dspark.engine.sequence import Sequence
from dspark.models.batch import VarlenBatch
from dspark.models.transformer import Transformer


class ModelRunner:
    def __init__(self, model: Transformer, max_batch: int, max_len: int, capture_layers: tuple[int, ...] = ()):
        self.model, self.max_len = model, max_len
        self.cache = model.new_cache(max_batch, max_len)
        # Which layers' states come back with the pass (the drafters' context features).
        self.capture_layers = tuple(capture_layers)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def run(self, seqs: list[Sequence], pieces: list[list[int]], logits_rows, greedy: bool = False):
        """The pass over `pieces[i]` appended to seqs[i]'s cached positions; logits_rows: 'last',
        'all' or the flat row indices to compute logits for; greedy: only their argmax (output.tokens).
        Returns (batch, model output)."""
        batch = VarlenBatch.build(pieces, [s.cached for s in seqs], [s.slot for s in seqs], device=self.device)
        if not isinstance(logits_rows, str):
            logits_rows = host_values(logits_rows, torch.long, self.device)
        return batch, self.model(batch, self.cache, capture_layers=self.capture_layers, logits_rows=logits_rows,
                                 greedy=greedy)
