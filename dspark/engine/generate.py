"""Plain autoregressive generation with continuous batching: the baseline every speedup is measured against.

Each step is one varlen pass: newly admitted sequences bring their prompt (prefill), running
ones bring their last sampled token (decode). Finished sequences free their slot at once, so
waiting requests join the next step.
"""
from __future__ import annotations

from collections import deque

import torch

from dspark.device import host_values
from dspark.models.batch import VarlenBatch
from dspark.engine.sequence import Sequence
from dspark.models.transformer import Transformer
from dspark.sampling import SamplingParams, logits_to_probs, sample_from_probs


def sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """Sample one token per row with each sequence's own parameters and generator."""
    device = logits.device
    probs = logits_to_probs(
        logits,
        host_values([s.params.temperature for s in seqs], torch.float32, device),
        host_values([s.params.top_k for s in seqs], torch.long, device),
        host_values([s.params.top_p for s in seqs], torch.float32, device),
    )
    return sample_from_probs(probs, [s.generator for s in seqs]).tolist()  # tokens out: the one copy to the host


class Engine:
    def __init__(self, model: Transformer, max_batch: int = 32, max_len: int = 2048,
                 max_prefill_tokens: int = 4096, eos_ids: tuple[int, ...] | None = None,
                 capture_layers: tuple[int, ...] = ()):
        self.model = model
        self.cache = model.new_cache(max_batch, max_len)
        self.max_len = max_len
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_ids = tuple(eos_ids if eos_ids is not None else model.config.eos_token_ids)
        # Data preparation records the target's states of every token it feeds (drafter features).
        self.capture_layers = tuple(capture_layers)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # ---- request lifecycle -------------------------------------------------------------
    def add(self, prompt: list[int], params: SamplingParams | None = None, req_id: str | None = None) -> Sequence:
        params = params or SamplingParams()
        params.validate()
        if not prompt:
            raise ValueError("prompt is empty")
        if len(prompt) >= self.max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context of {self.max_len}")
        seq = Sequence(list(prompt), params, max_len=self.max_len)
        if req_id is not None:
            seq.req_id = req_id
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        from dspark.engine.sequence import FinishReason

        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish = seq.finish or FinishReason.ABORT
        self._release(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots, within the prefill token budget."""
        admitted, budget = [], self.max_prefill_tokens
        while self.waiting and self.cache.num_free and (not admitted or len(self.waiting[0].prompt) <= budget):
            seq = self.waiting.popleft()
            seq.slot = self.cache.allocate()
            budget -= len(seq.prompt)
            admitted.append(seq)
        self.running.extend(admitted)
        return admitted

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot is not None:
            self.cache.free(seq.slot)
            seq.slot = None

    # ---- one step ----------------------------------------------------------------------
    def step(self) -> list[tuple[Sequence, list[int]]]:
        """One target pass; returns the tokens each sequence gained."""
        self._admit()
        seqs = list(self.running)
        if not seqs:
            return []
        batch = VarlenBatch.build([s.pending() for s in seqs], [s.cached for s in seqs], [s.slot for s in seqs],
                                  device=self.model.device)
        out = self.model(batch, self.cache, capture_layers=self.capture_layers, logits_rows="last")
        tokens = sample_rows(out.logits, seqs)
        events = []
        for b, (seq, tok) in enumerate(zip(seqs, tokens)):
            if self.capture_layers:
                rows = batch.seq_rows(b)
                # The full-vocabulary log-normaliser of the row that predicts the next token:
                # trainers need it to turn a draft-vocabulary slice of the logits into probabilities.
                lse = torch.full((rows.stop - rows.start,), float("nan"), device=out.logits.device)
                lse[-1] = torch.logsumexp(out.logits[b], dim=-1)
                seq.captured.append((out.features[rows].to(torch.bfloat16), out.hidden[rows].to(torch.bfloat16), lse))
            seq.cached = len(seq.tokens)
            seq.append(tok, self.eos_ids)
            events.append((seq, [tok]))
            if seq.done:
                self._release(seq)
        return events

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 progress=None) -> list[Sequence]:
        """Run prompts to completion with continuous batching; returns finished sequences in order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        seqs = [self.add(p, sp) for p, sp in zip(prompts, params_list)]
        while self.has_work():
            events = self.step()
            if progress is not None:
                progress(events)
        return seqs
