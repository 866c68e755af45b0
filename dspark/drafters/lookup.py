"""LookupDrafter: prompt lookup in front of a trained drafter (DSpark, DFlash or EAGLE-3).

Per request, when the text's current suffix (at least min_n tokens, ending at the anchor) occurred
earlier in its context, the block is what followed it then (NgramIndex), every token proposed with
q = 1. A point mass is a draft distribution like any other: verification accepts the token with
probability p(token) (at T 0: when it is the argmax) and otherwise samples from p without it, so
the output is still exactly the target's. Requests without a match get the trained drafter's block;
requests with one skip it. Their new context rows wait (here for a local drafter, in RemoteDrafter
for the drafter service) and reach the drafter in one batch when it drafts for them again, so a
step that lookup answers costs no drafter compute and no round trip.

With a datastore (datastore.py: the target's own answers to other prompts), a request whose text did
not repeat itself looks there next: the most frequent continuation of its suffix across those answers,
taken when at least `min_share` of the occurrences went on with its first token. Both are lookups:
point masses, no drafter compute, the same verification.

Confidences of lookup blocks are what lookup has earned: per match length (prompt lookup) or first-token
share (datastore) and block position, the share of its past guesses that the tokens decided since
confirmed (LookupStats), as logits that the policy takes as they are (DraftBlock.calibrated) beside the
drafter's calibrated ones. Positions past a short guess get NO_GUESS (never worth verifying; a
fixed-length policy verifies them anyway, harmlessly).
"""
from __future__ import annotations

import math

import torch

from dspark.drafters.base import DraftBlock, merge_rows
from dspark.drafters.datastore import Datastore
from dspark.drafters.ngram_index import NgramIndex

NO_GUESS = -30.0  # confidence logit of a slot that lookup had nothing for
FLUSH_ROWS = 64  # context rows held back from the drafter at most (bounds what a long loop keeps here)
SHARE_BUCKETS = 10  # datastore guesses are scored by their first token's share, in tenths


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
    """The DrafterContract of `inner` (a local drafter or the verifier's RemoteDrafter), with
    prompt lookup first. It runs where the tokens are: in process, or in the verifier, where a
    lookup block costs no round trip to the drafter service. Anything else about the drafter
    (its config, DrafterInfo, calibration) is the inner drafter's."""

    def __init__(self, inner, min_n: int = 2, max_n: int = 4, datastore: Datastore | None = None,
                 min_share: float = 0.5):
        self.inner, self.min_n, self.max_n = inner, min_n, max_n
        self.datastore, self.min_share = datastore, min_share
        self.stats = LookupStats(max_n, inner.gamma)  # prompt lookup's, by match length
        self.datastore_stats = LookupStats(SHARE_BUCKETS, inner.gamma)  # the datastore's, by first share
        self._texts: dict[str, NgramIndex] = {}
        self._held: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # rows not given to the drafter yet
        # req -> (anchor position, guess, its stats, their key)
        self._guesses: dict[str, tuple[int, list[int], LookupStats, int]] = {}
        self._looked_up: set[str] = set()  # requests whose last block was lookup's

    # ---- what it is: the inner drafter's ----
    gamma = property(lambda self: self.inner.gamma)
    ctx_layers = property(lambda self: self.inner.ctx_layers)
    kind = property(lambda self: self.inner.kind)
    version = property(lambda self: self.inner.version)
    remote = property(lambda self: self.inner.remote)
    drafts_ahead = property(lambda self: self.inner.drafts_ahead)

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ---- contexts: the inner drafter's, the rows held back, and the tokens ----
    def context_len(self, req_id: str) -> int:
        return self.inner.context_len(req_id) + sum(len(t) for _, t in self._held.get(req_id, ()))

    def extend_context(self, req_id: str, features: torch.Tensor, tokens: torch.Tensor) -> None:
        self._text(req_id).sync(tokens.tolist(), start=self.context_len(req_id))  # free_draft may know them
        if self.inner.remote:  # a remote drafter holds new rows itself until it next sends
            self.inner.extend_context(req_id, features, tokens)
            return
        held = self._held.setdefault(req_id, [])
        held.append((features, tokens))
        if sum(len(t) for _, t in held) >= FLUSH_ROWS:
            self._flush(req_id)

    def rollback(self, req_id: str, n_ctx: int) -> None:
        self._text(req_id).truncate(n_ctx)
        keep = n_ctx - self.inner.context_len(req_id)
        if keep < 0:
            self._held.pop(req_id, None)
            self.inner.rollback(req_id, n_ctx)
            return
        held = []
        for features, tokens in self._held.pop(req_id, ()):
            if keep <= 0:
                break
            take = min(keep, len(tokens))
            held.append((features[:take], tokens[:take]))
            keep -= take
        if held:
            self._held[req_id] = held

    def release(self, req_id: str) -> None:
        self.inner.release(req_id)
        for table in (self._texts, self._guesses, self._held):
            table.pop(req_id, None)
        self._looked_up.discard(req_id)

    def _flush(self, req_id: str) -> None:
        held = self._held.pop(req_id, None)
        if held:
            self.inner.extend_context(req_id, torch.cat([f for f, _ in held]), torch.cat([t for _, t in held]))

    def push(self) -> None:
        self.inner.push()

    def probe(self, req_ids, anchors, temperatures) -> bool:
        return self.inner.probe(req_ids, anchors, temperatures)

    def draft_ahead(self, req_ids, anchors, gaps, temperatures) -> None:
        """The drafter's, for the requests it drafted: lookup's next guess costs nothing when it comes."""
        rest = [i for i, r in enumerate(req_ids) if r not in self._looked_up]
        for i in rest:  # a local drafter drafts ahead from all it has been given
            self._flush(req_ids[i])
        if rest:
            self.inner.draft_ahead(*([v[i] for i in rest] for v in (req_ids, anchors, gaps, temperatures)))

    def probe_result(self):
        return self.inner.probe_result()

    def _text(self, req_id: str) -> NgramIndex:
        text = self._texts.get(req_id)
        if text is None:
            text = self._texts[req_id] = NgramIndex(self.min_n, self.max_n)
        return text

    # ---- drafting ----
    def draft(self, req_ids: list[str], anchors: torch.Tensor, temperatures: torch.Tensor, generators: list,
              forced_tokens: torch.Tensor | None = None, return_logits: bool = False, gaps=None) -> DraftBlock:
        if forced_tokens is not None or return_logits or gaps is not None:
            # Teacher-forced scoring, or a draft ahead of the tokens lookup knows: the drafter's own.
            for req_id in req_ids:
                self._flush(req_id)
            ahead = {} if gaps is None else {"gaps": gaps}
            return self.inner.draft(req_ids, anchors, temperatures, generators, forced_tokens, return_logits, **ahead)
        guesses = self._look_up(req_ids, anchors.tolist())
        self._looked_up = {req_ids[i] for i in guesses}
        rest = [i for i in range(len(req_ids)) if i not in guesses]
        inner = None
        if rest:
            for i in rest:
                self._flush(req_ids[i])
            pick = torch.tensor(rest, device=anchors.device)
            inner = self.inner.draft([req_ids[i] for i in rest], anchors[pick], temperatures[pick],
                                     [generators[i] for i in rest])
            if not guesses:
                return inner
        return self._merge(len(req_ids), guesses, rest, inner, anchors.device)

    def free_draft(self, req_ids: list[str], texts: list[list[int]], device=None) -> DraftBlock | None:
        """Lookup's blocks alone (NO_GUESS rows where it has none), or None when it has none. Needs
        only each request's tokens (the last one its anchor): the drafter's context is not touched."""
        if not self.inner.has_confidence:
            return None
        for req_id, text in zip(req_ids, texts):
            index = self._text(req_id)
            index.sync(text[len(index):-1], start=len(index))  # only what it lacks: no copy of the text
        guesses = self._look_up(req_ids, [text[-1] for text in texts])
        return self._merge(len(req_ids), guesses, [], None, device) if guesses else None

    def _look_up(self, req_ids: list[str], anchors: list[int]) -> dict[int, tuple[list[int], list[float]]]:
        """{row: (guess, confidence logits)} for the requests whose suffix occurred before, in their own
        text or in the datastore; remembered for scoring."""
        guesses = {}
        for i, (req_id, anchor) in enumerate(zip(req_ids, anchors)):
            text = self._text(req_id)
            self._settle(req_id, text, anchor)
            guess, key = text.continuation(anchor, self.gamma)
            stats = self.stats
            if not key:
                guess, key = self._datastore_guess(text, anchor)
                stats = self.datastore_stats
            if guess:
                guesses[i] = (guess, stats.logits(key, len(guess)))
                self._guesses[req_id] = (len(text), guess, stats, key)
        return guesses

    def _datastore_guess(self, text: NgramIndex, anchor: int) -> tuple[list[int], int]:
        """(guess, its stats key: the first token's share in tenths) from the datastore, when that first
        token followed at least min_share of the occurrences; else no guess."""
        if self.datastore is None:
            return [], 0
        guess, shares, _, _ = self.datastore.continuation(text.tokens[-self.datastore.max_n:] + [anchor], self.gamma)
        if not guess or shares[0] < self.min_share:
            return [], 0
        return guess, min(int(shares[0] * SHARE_BUCKETS), SHARE_BUCKETS)

    def _settle(self, req_id: str, text: NgramIndex, anchor: int) -> None:
        """Score this request's last guess against the tokens decided since (the anchor included)."""
        last = self._guesses.pop(req_id, None)
        if last is not None:
            position, guess, stats, key = last
            decided = text.tokens[position + 1:] + [anchor]
            stats.record(key, guess, decided)

    def _merge(self, num: int, guesses: dict, rest: list[int], inner: DraftBlock | None, device) -> DraftBlock:
        """One block: lookup's rows as point masses with lookup's confidences (taken as they are), the
        drafter's rows as it drafted them; rows in neither (free drafts without a match) token 0 at
        NO_GUESS."""
        gamma, mine = self.gamma, [i for i in range(num) if i not in set(rest)]
        rows, conf_rows = [[0] * gamma for _ in mine], [[NO_GUESS] * gamma for _ in mine]
        for j, i in enumerate(mine):
            if i in guesses:
                guess, conf_rows[j] = guesses[i]
                rows[j] = guess + [guess[-1]] * (gamma - len(guess))  # past the guess: a filler, NO_GUESS
        tokens = torch.tensor(rows, dtype=torch.long, device=device)  # built on the host, one copy
        conf = torch.tensor(conf_rows, dtype=torch.float32, device=device) if self.inner.has_confidence else None
        lookup = DraftBlock(tokens, conf, tokens[..., None], torch.ones(len(mine), gamma, 1, device=device),
                            calibrated=torch.ones(len(mine), dtype=torch.bool, device=device))
        return lookup if inner is None else merge_rows(num, [(mine, lookup), (rest, inner)])
