"""Which sequences run each step: a waiting queue, the running batch, a KV slot per running one.

Admission is first come, first served, into free slots, within a prefill token budget per step
(one long prompt always gets in alone). A finished or aborted sequence frees its slot at once,
so a waiting one joins the next step. With reuse_prefixes a sequence takes the free slot that
already holds the longest prefix of its prompt (dspark/models/kv_cache.py) and starts with those
tokens cached: its prefill computes only the rest (at least the prompt's last token, whose logits
pick the first output).
"""
from __future__ import annotations

from collections import deque

from dspark.engine.sequence import FinishReason, Sequence
from dspark.models.kv_cache import KVCache


class Scheduler:
    def __init__(self, cache: KVCache, max_prefill_tokens: int = 4096, reuse_prefixes: bool = False):
        self.cache, self.max_prefill_tokens, self.reuse_prefixes = cache, max_prefill_tokens, reuse_prefixes
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots, within the prefill token budget."""
        admitted, budget = [], self.max_prefill_tokens
        while self.waiting and self.cache.num_free and (not admitted or len(self.waiting[0].prompt) <= budget):
            seq = self.waiting.popleft()
            if self.reuse_prefixes:
                seq.slot, seq.cached, seq.prefix_source = self.cache.allocate_reusing(seq.prompt, len(seq.prompt) - 1)
            else:
                seq.slot = self.cache.allocate()
            budget -= len(seq.prompt)
            admitted.append(seq)
        self.running.extend(admitted)
        return admitted

    def release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot is not None:
            # What the slot holds for a later prompt: the positions the sequence had decided.
            self.cache.free(seq.slot, seq.tokens[:seq.cached] if self.reuse_prefixes else None)
            seq.slot = None

    def abort(self, seq: Sequence) -> None:
        """Off the queue and marked aborted; the engine then releases it (slot and all)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish = seq.finish or FinishReason.ABORT
