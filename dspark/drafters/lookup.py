"""LookupDrafter: prompt lookup in front of a trained drafter (DSpark, DFlash or EAGLE-3).

Per request, when the text's current suffix (at least min_n tokens, ending at the anchor) occurred
earlier in its context, the block is what followed it then (NgramIndex), every token proposed with
q = 1. A point mass is a draft distribution like any other: verification accepts the token with
probability p(token) (at T 0: when it is the argmax) and otherwise samples from p without it, so
the output is still exactly the target's. Requests without a match get the trained drafter's block;
requests with one skip it (the drafter's context is still extended, so it is current when needed).

Confidences of lookup blocks are what lookup has earned: per match length and block position, the
share of its past guesses that the tokens decided since confirmed (LookupStats), as logits, so
the scheduler weighs lookup and drafter blocks on one scale. Positions past a short guess get
NO_GUESS (never worth verifying; a fixed-length policy verifies them anyway, harmlessly).
"""
from __future__ import annotations

import math

import torch

from dspark.drafters.base import DraftBlock
from dspark.drafters.ngram_index import NgramIndex

NO_GUESS = -30.0  # confidence logit of a slot that lookup had nothing for


class LookupStats:
    """P(guess j confirmed | guesses 1..j-1 confirmed) per match length n, Beta(1, 1)-smoothed."""

    def __init__(self, max_n: int, gamma: int):
        self.hits = [[0] * gamma for _ in range(max_n + 1)]
        self.tries = [[0] * gamma for _ in range(max_n + 1)]

    def record(self, n: int, guessed: list[int], decided: list[int]) -> None:
        """`decided`: the tokens at the guessed positions known so far (may be fewer)."""
        for j, (guess, token) in enumerate(zip(guessed, decided)):
            self.tries[n][j] += 1
            if guess != token:
                return
            self.hits[n][j] += 1

    def logits(self, n: int, length: int) -> list[float]:
        out = []
        for j in range(len(self.hits[n])):
            p = (self.hits[n][j] + 1) / (self.tries[n][j] + 2)
            out.append(math.log(p / (1 - p)) if j < length else NO_GUESS)
        return out


class LookupDrafter:
    """The DrafterContract of `inner`, with prompt lookup first. Local only: in a split
    deployment it runs inside the drafter service, where the contexts are."""

    def __init__(self, inner, min_n: int = 2, max_n: int = 4):
        self.inner, self.min_n, self.max_n = inner, min_n, max_n
        self.stats = LookupStats(max_n, inner.gamma)
        self._texts: dict[str, NgramIndex] = {}
        self._guesses: dict[str, tuple[int, list[int], int]] = {}  # req -> (anchor position, guess, n)

    # ---- what it is: the inner drafter's ----
    gamma = property(lambda self: self.inner.gamma)
    ctx_layers = property(lambda self: self.inner.ctx_layers)
    kind = property(lambda self: self.inner.kind)
    version = property(lambda self: self.inner.version)
    cfg = property(lambda self: self.inner.cfg)
    has_confidence = property(lambda self: self.inner.has_confidence)
    contexts = property(lambda self: self.inner.contexts)
    remote = property(lambda self: False)

    # ---- contexts: the inner drafter's, plus the tokens ----
    def context_len(self, req_id: str) -> int:
        return self.inner.context_len(req_id)

    def extend_context(self, req_id: str, features: torch.Tensor, tokens: torch.Tensor) -> None:
        self.inner.extend_context(req_id, features, tokens)
        self._text(req_id).append(tokens.tolist())

    def rollback(self, req_id: str, n_ctx: int) -> None:
        self.inner.rollback(req_id, n_ctx)
        self._text(req_id).truncate(n_ctx)

    def release(self, req_id: str) -> None:
        self.inner.release(req_id)
        self._texts.pop(req_id, None)
        self._guesses.pop(req_id, None)

    def push(self) -> None:
        pass

    def probe(self, req_ids, anchors, temperatures) -> bool:
        return False

    def probe_result(self):
        return None

    def _text(self, req_id: str) -> NgramIndex:
        text = self._texts.get(req_id)
        if text is None:
            text = self._texts[req_id] = NgramIndex(self.min_n, self.max_n)
        return text

    # ---- drafting ----
    def draft(self, req_ids: list[str], anchors: torch.Tensor, temperatures: torch.Tensor, generators: list,
              forced_tokens: torch.Tensor | None = None, return_logits: bool = False) -> DraftBlock:
        if forced_tokens is not None or return_logits:  # teacher-forced scoring: the drafter's own
            return self.inner.draft(req_ids, anchors, temperatures, generators, forced_tokens, return_logits)
        gamma, anchor_ids = self.gamma, anchors.tolist()
        guesses = {}
        for i, (req_id, anchor) in enumerate(zip(req_ids, anchor_ids)):
            text = self._text(req_id)
            self._settle(req_id, text, anchor)
            guess, n = text.continuation(anchor, gamma)
            if n:
                guesses[i] = (guess, n)
                self._guesses[req_id] = (len(text), guess, n)
        rest = [i for i in range(len(req_ids)) if i not in guesses]
        inner = None
        if rest:
            pick = torch.tensor(rest, device=anchors.device)
            inner = self.inner.draft([req_ids[i] for i in rest], anchors[pick], temperatures[pick],
                                     [generators[i] for i in rest])
            if not guesses:
                return inner
        return self._merge(len(req_ids), guesses, rest, inner, anchors.device)

    def _settle(self, req_id: str, text: NgramIndex, anchor: int) -> None:
        """Score this request's last guess against the tokens decided since (the anchor included)."""
        last = self._guesses.pop(req_id, None)
        if last is not None:
            position, guess, n = last
            decided = text.tokens[position + 1:] + [anchor]
            self.stats.record(n, guess, decided)

    def _merge(self, num: int, guesses: dict, rest: list[int], inner: DraftBlock | None, device) -> DraftBlock:
        gamma = self.gamma
        support = inner.support_ids.shape[-1] if inner is not None else 1
        tokens = torch.zeros(num, gamma, dtype=torch.long, device=device)
        support_ids = torch.zeros(num, gamma, support, dtype=torch.long, device=device)
        support_probs = torch.zeros(num, gamma, support, dtype=torch.float32, device=device)
        with_conf = self.inner.has_confidence
        conf = torch.zeros(num, gamma, dtype=torch.float32, device=device) if with_conf else None
        for i, (guess, n) in guesses.items():
            padded = guess + [guess[-1]] * (gamma - len(guess))  # past the guess: a filler, NO_GUESS
            tokens[i] = torch.tensor(padded, device=device)
            support_ids[i, :, 0] = tokens[i]
            support_probs[i, :, 0] = 1.0
            if with_conf:
                conf[i] = torch.tensor(self.stats.logits(n, len(guess)), device=device)
        if inner is not None:
            pick = torch.tensor(rest, device=device)
            tokens[pick], support_ids[pick], support_probs[pick] = inner.tokens, inner.support_ids, inner.support_probs
            if with_conf:
                conf[pick] = inner.conf_logits.float()
        return DraftBlock(tokens, conf, support_ids, support_probs)
