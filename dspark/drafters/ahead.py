"""Draft-ahead: the next block drafted while the target verifies this one, on a guess.

The engine (dspark/speculative/engine.py, _draft_ahead) guesses that each request's verified drafts
are all accepted and that the target's next token is the drafter's next draft; the drafter drafts
from that anchor with the context it has (the guessed positions' features do not exist yet). At
the next step a request whose anchor turned out to be the guessed one, at the guessed position,
takes that block; the others are drafted afresh. Any block is lossless to verify: which one is
used depends only on tokens already decided.

`Guesses` is that check, shared by the remote drafter (verifier_svc/remote_drafter.py, where the
drafter service drafts ahead beside the verifier) and `DraftAheadThread`, the same in one process.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from dspark.drafters.base import DraftBlock, merge_rows


class Guesses:
    """Per request, the (anchor position, anchor token) its block drafted ahead assumed."""

    def __init__(self, req_ids: list[str], positions: list[int], anchors: list[int]):
        self.by_request = {r: (int(p), int(a)) for r, p, a in zip(req_ids, positions, anchors)}

    def held(self, req_ids: list[str], positions: list[int], anchors: list[int]) -> list[int]:
        """Rows of req_ids whose anchor is the guessed one at the guessed position."""
        return [i for i, r in enumerate(req_ids) if self.by_request.get(r) == (int(positions[i]), int(anchors[i]))]

    def split(self, req_ids: list[str], positions: list[int], anchors: list[int]) -> tuple[list[int], list[int]]:
        """(rows whose guess held, rows to draft afresh), each in order."""
        held = self.held(req_ids, positions, anchors)
        return held, [i for i in range(len(req_ids)) if i not in set(held)]


class DraftAheadThread:
    """A local block drafter that drafts ahead on a thread of its own, beside the engine thread's
    target pass. The thread runs torch with one intra-op thread: a second OpenMP team would spin
    beside the target's. Every call that touches the drafter's contexts first waits for the draft
    ahead in flight, so the two threads never use them at once."""

    def __init__(self, inner):
        if not inner.drafts_ahead:
            raise ValueError(f"a {inner.kind} drafter does not draft ahead")
        self.inner = inner
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="draft-ahead", initializer=torch.set_num_threads,
                                        initargs=(1,))
        self._job: tuple[Guesses, list[str], Future] | None = None
        self.rows_ahead = self.rows_used = 0  # blocks drafted ahead, and those whose guess held

    # ---- what it is: the inner drafter's ----
    gamma = property(lambda self: self.inner.gamma)
    ctx_layers = property(lambda self: self.inner.ctx_layers)
    kind = property(lambda self: self.inner.kind)
    version = property(lambda self: self.inner.version)
    remote = property(lambda self: False)
    drafts_ahead = property(lambda self: True)

    def __getattr__(self, name: str):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def push(self) -> None:
        """Nothing to send: in process the context is current once extended."""

    def probe(self, req_ids, anchors, temperatures) -> bool:
        return False

    def probe_result(self):
        return None

    def free_draft(self, req_ids, texts, device=None):
        return None

    def _settle(self) -> None:
        if self._job is not None:
            self._job[2].exception()  # waits; a failed draft ahead is only a draft not made

    def context_len(self, req_id: str) -> int:
        return self.inner.context_len(req_id)

    def extend_context(self, req_id, features, tokens) -> None:
        self._settle()
        self.inner.extend_context(req_id, features, tokens)

    def rollback(self, req_id: str, n_ctx: int) -> None:
        self._settle()
        self.inner.rollback(req_id, n_ctx)

    def release(self, req_id: str) -> None:
        self._settle()
        self.inner.release(req_id)

    def draft_ahead(self, req_ids, anchors, gaps, temperatures) -> None:
        self._settle()
        device = getattr(self.inner, "lm_head_draft", torch.empty(0)).device
        positions = [self.inner.context_len(r) + g for r, g in zip(req_ids, gaps)]
        future = self._pool.submit(self.inner.draft, list(req_ids), torch.tensor(anchors, device=device),
                                   torch.tensor(temperatures, dtype=torch.float32, device=device),
                                   [None] * len(req_ids), gaps=list(gaps))
        self._job = (Guesses(req_ids, positions, anchors), list(req_ids), future)
        self.rows_ahead += len(req_ids)

    def draft(self, req_ids, anchors, temperatures, generators, forced_tokens=None, return_logits=False,
              gaps=None) -> DraftBlock:
        self._settle()
        job, self._job = self._job, None
        extra = {k: v for k, v in dict(forced_tokens=forced_tokens, return_logits=return_logits, gaps=gaps).items()
                 if v is not None and v is not False}
        if extra or job is None or job[2].exception():
            return self.inner.draft(req_ids, anchors, temperatures, generators, **extra)
        guesses, ahead_ids, future = job
        anchor_list = anchors.tolist()
        held, fresh = guesses.split(req_ids, [self.inner.context_len(r) for r in req_ids], anchor_list)
        ahead = future.result()
        self.rows_used += len(held)
        ahead_rows = [ahead_ids.index(req_ids[i]) for i in held]
        held_block = DraftBlock(*(None if t is None else t[ahead_rows] for t in (
            ahead.tokens, ahead.conf_logits, ahead.support_ids, ahead.support_probs)))
        if not fresh:
            return held_block
        pick = torch.tensor(fresh, device=anchors.device)
        block = self.inner.draft([req_ids[i] for i in fresh], anchors[pick], temperatures[pick],
                                 [generators[i] for i in fresh])
        return block if not held else merge_rows(len(req_ids), [(held, held_block), (fresh, block)])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
