"""Plain autoregressive generation with continuous batching: the baseline every speedup is measured against.

The engine is three parts, as nano-vllm splits it: the scheduler (who runs, dspark/engine/
scheduler.py), the model runner (one varlen pass, model_runner.py) and the sampler (sampler.py).
Each step is one pass: newly admitted sequences bring their prompt (prefill), running ones their
last sampled token (decode).
"""
from __future__ import annotations

import torch

from dspark.engine.model_runner import ModelRunner
from dspark.engine.sampler import sample_rows
from dspark.engine.scheduler import Scheduler
from dspark.engine.sequence import Sequence
from dspark.models.transformer import Transformer
from dspark.sampling import SamplingParams


class Engine:
    def __init__(self, model: Transformer, max_batch: int = 32, max_len: int = 2048,
                 max_prefill_tokens: int = 4096, eos_ids: tuple[int, ...] | None = None,
                 capture_layers: tuple[int, ...] = (), reuse_prefixes: bool | None = None):
        """reuse_prefixes: a new sequence skips the prompt prefix a freed KV slot still holds
        (scheduler.py); default on, but off where a trainer captures every fed token's states."""
        self.model, self.max_len = model, max_len
        # Data preparation records the target's states of every token it feeds (drafter features).
        self.runner = ModelRunner(model, max_batch, max_len, capture_layers)
        reuse = not capture_layers if reuse_prefixes is None else reuse_prefixes
        self.scheduler = Scheduler(self.runner.cache, max_prefill_tokens, reuse)
        self.eos_ids = tuple(eos_ids if eos_ids is not None else model.config.eos_token_ids)

    # Read by load reports, the SPS profiler and tests.
    @property
    def cache(self):
        return self.runner.cache

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.runner.capture_layers

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def waiting(self):
        return self.scheduler.waiting

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
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)
        self._release(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def _release(self, seq: Sequence) -> None:
        self.scheduler.release(seq)

    # ---- one step ----------------------------------------------------------------------
    def step(self) -> list[tuple[Sequence, list[int]]]:
        """One target pass; returns the tokens each sequence gained."""
        self.scheduler.admit()
        seqs = list(self.running)
        if not seqs:
            return []
        # All greedy: the argmax alone (unless a trainer captures the logits' normaliser too).
        greedy = all(s.params.temperature <= 0 for s in seqs) and not self.capture_layers
        batch, out = self.runner.run(seqs, [s.pending() for s in seqs], logits_rows="last", greedy=greedy)
        tokens = out.tokens.tolist() if greedy else sample_rows(out.logits, seqs)
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
