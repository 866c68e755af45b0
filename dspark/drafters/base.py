"""The one inference interface the speculative loop and the drafter service use.

A drafter keeps, per request, a cache built from the target features of the decided positions
0..n-1 (its "context"). `draft` proposes gamma tokens for positions a+1..a+gamma after the
anchor token x_a at position a = n (method.md 1).

Every drafter shares the target's embedding and LM head. They are frozen buffers, never saved
with the drafter. With a draft vocabulary (the N most frequent target tokens) the LM head is
cut to those rows: tokens outside it get q = 0 and are never proposed, which stays lossless.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark.drafters.config import DrafterConfig
from dspark.drafters.context import ContextCache
from dspark.sampling import truncated_draft_distribution


@dataclass
class DraftBlock:
    tokens: torch.Tensor  # [R, gamma] int64 target token ids x_1..x_gamma
    conf_logits: torch.Tensor | None  # [R, gamma] float32 raw confidence logits z_k (DSpark only)
    support_ids: torch.Tensor  # [R, gamma, S] int64 target ids of the support each x_k was drawn from
    support_probs: torch.Tensor  # [R, gamma, S] float32 its probabilities (rows sum to 1, zero-padded)
    logits: torch.Tensor | None = None  # [R, gamma, V'] float32 slot logits over the draft vocab (on request)
    # [R] bool: rows whose conf_logits are calibrated already (prompt lookup's own record), to be
    # taken as they are rather than through the drafter's STS temperatures and live offset
    calibrated: torch.Tensor | None = None


def merge_rows(num: int, parts: list[tuple[list[int], DraftBlock]]) -> DraftBlock:
    """One block of `num` rows from blocks of some of them: parts = (row indices, block of those rows).
    Supports are zero-padded to the widest; confidences only if every part has them."""
    width = max(b.support_ids.shape[-1] for _, b in parts)
    first = parts[0][1]
    gamma, device = first.tokens.shape[1], first.tokens.device
    tokens = torch.zeros(num, gamma, dtype=torch.long, device=device)
    support_ids = torch.zeros(num, gamma, width, dtype=torch.long, device=device)
    support_probs = torch.zeros(num, gamma, width, dtype=torch.float32, device=device)
    has_conf = all(b.conf_logits is not None for _, b in parts)
    conf = torch.zeros(num, gamma, dtype=torch.float32, device=device) if has_conf else None
    calibrated = torch.zeros(num, dtype=torch.bool, device=device)
    for rows, block in parts:
        pick = torch.tensor(rows, dtype=torch.long, device=device)
        s = block.support_ids.shape[-1]
        tokens[pick] = block.tokens
        support_ids[pick, :, :s], support_probs[pick, :, :s] = block.support_ids, block.support_probs.float()
        if has_conf:
            conf[pick] = block.conf_logits.float()
        if block.calibrated is not None:
            calibrated[pick] = block.calibrated
    return DraftBlock(tokens, conf, support_ids, support_probs, calibrated=calibrated if calibrated.any() else None)


class Drafter(nn.Module):
    # What it computes decides only what is proposed, never what is accepted: a precision may
    # approximate its matmuls (under gguf they get Q8_0 blocks made at load).
    exact_matmuls = False

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 draft_vocab: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg = cfg.resolved()
        if embed_weight.shape != (cfg.vocab_size, cfg.hidden_size) or lm_head_weight.shape != embed_weight.shape:
            raise ValueError(f"target embedding/LM head must be [{cfg.vocab_size}, {cfg.hidden_size}], "
                             f"got {tuple(embed_weight.shape)} and {tuple(lm_head_weight.shape)}")
        if draft_vocab is None:
            draft_vocab = torch.arange(cfg.draft_vocab)
        if draft_vocab.shape != (cfg.draft_vocab,):
            raise ValueError(f"draft_vocab must have {cfg.draft_vocab} ids, got {tuple(draft_vocab.shape)}")
        # Frozen target weights: buffers (not parameters), not persistent (not in the checkpoint).
        self.register_buffer("embed_weight", embed_weight.detach().float(), persistent=False)
        self.register_buffer("lm_head_full", lm_head_weight.detach().float(), persistent=False)
        self.register_buffer("draft_vocab", draft_vocab.long().clone())  # [V'] draft index -> target id
        self.register_buffer("lm_head_draft", self.lm_head_full[self.draft_vocab].clone(), persistent=False)
        self.register_buffer("draft_index", self._draft_index(), persistent=False)
        self.contexts = ContextCache()

    def _draft_index(self) -> torch.Tensor:
        """[V]: target id -> draft-vocabulary index, -1 outside it."""
        table = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=self.draft_vocab.device)
        table[self.draft_vocab] = torch.arange(self.cfg.draft_vocab, device=self.draft_vocab.device)
        return table

    # ---- identity ----
    @property
    def gamma(self) -> int:
        return self.cfg.gamma

    @property
    def kind(self) -> str:
        return self.cfg.kind

    @property
    def version(self) -> str:
        return self.cfg.version

    @property
    def ctx_layers(self) -> list[int]:
        return list(self.cfg.ctx_layers)

    @property
    def has_confidence(self) -> bool:
        return self.cfg.confidence

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # A loaded draft vocabulary changes which LM-head rows the drafter uses.
        self.lm_head_draft = self.lm_head_full[self.draft_vocab].clone()
        self.draft_index = self._draft_index()

    # ---- shared pieces ----
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_weight[tokens]

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Base logits over the draft vocabulary through the target's (frozen) LM head."""
        head = self.__dict__.get("_draft_head")
        return head(hidden) if head is not None else hidden @ self.lm_head_draft.T

    def use_precision(self, precision: str) -> None:
        """Inference: the draft LM head on the precision's kernels as well (dspark.models.precision
        calls this). It is a frozen buffer, not an nn.Linear, so the conversion would pass it by;
        kept off the module tree, so the checkpoint does not change. At one request it was 2.8 of a
        draft's 11.7 ms in fp32 on an AMX CPU."""
        from dspark.models.precision import GGUF_PRECISIONS, approximate_in_blocks, convert_linear

        head = nn.Linear(self.cfg.hidden_size, self.cfg.draft_vocab, bias=False, device=self.lm_head_draft.device)
        head.weight = nn.Parameter(self.lm_head_draft, requires_grad=False)
        if precision in GGUF_PRECISIONS:
            approximate_in_blocks(head)
        self.__dict__["_draft_head"] = convert_linear(head, precision)

    def to_draft_index(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft-vocabulary index, -1 for tokens outside it."""
        return self.draft_index[target_ids]

    def sample_slot(self, logits: torch.Tensor, temperatures: torch.Tensor, generators: list,
                    forced: torch.Tensor | None = None):
        """Draw one slot for every request from the compact exact q (top-S of softmax(logits / T)).

        Returns target ids: (tokens [R], support_ids [R, S], support_probs [R, S]). With `forced`
        (target ids) the tokens are replaced, for teacher-forced scoring; q is still reported.
        """
        support = min(self.cfg.support_size, logits.shape[-1])
        tokens, ids, probs = truncated_draft_distribution(logits, temperatures, support, generators)
        tokens, ids = self.draft_vocab[tokens], self.draft_vocab[ids]
        if forced is not None:
            tokens = forced.long()
        return tokens, ids, probs

    # ---- context cache (what every drafter stores is its own business) ----
    def context_len(self, req_id: str) -> int:
        return self.contexts.length(req_id)

    def rollback(self, req_id: str, n_ctx: int) -> None:
        self.contexts.truncate(req_id, n_ctx)

    def release(self, req_id: str) -> None:
        self.contexts.release(req_id)

    def extend_context(self, req_id: str, features: torch.Tensor, tokens: torch.Tensor) -> None:
        raise NotImplementedError

    @property
    def remote(self) -> bool:
        return False

    @property
    def drafts_ahead(self) -> bool:
        """Whether draft() takes `gaps` (an anchor past the context, for draft-ahead)."""
        return False

    def push(self) -> None:
        """Nothing to send: a local drafter's context is current as soon as it is extended."""

    def probe(self, req_ids: list[str], anchors: torch.Tensor, temperatures: torch.Tensor) -> bool:
        """False: in process nothing runs beside the target, so a probe is a plain draft."""
        return False

    def probe_result(self):
        return None

    def free_draft(self, req_ids: list[str], texts: list[list[int]], device=None) -> DraftBlock | None:
        """None: every draft of a trained drafter costs a forward pass."""
        return None

    def draft_ahead(self, req_ids, anchors, gaps, temperatures) -> None:
        """Nothing: in process the target's pass already uses the cores a drafter would."""

    @torch.no_grad()
    def warm_up(self) -> None:
        """One greedy draft for a throwaway request, so that what a first draft builds (DSpark's bias
        table after every draft token: 0.23 s on a 2-core CPU) and every kernel's first call are paid
        before a service reports SERVING, not by its first request."""
        req_id = "__warm_up__"
        width = len(self.ctx_layers) * self.cfg.hidden_size
        device = self.lm_head_draft.device
        self.extend_context(req_id, torch.zeros(4, width, device=device), torch.zeros(4, dtype=torch.long, device=device))
        try:
            self.draft([req_id], torch.zeros(1, dtype=torch.long, device=device), torch.zeros(1, device=device), [None])
        finally:
            self.release(req_id)

    def draft(self, req_ids: list[str], anchors: torch.Tensor, temperatures: torch.Tensor, generators: list,
              forced_tokens: torch.Tensor | None = None, return_logits: bool = False) -> DraftBlock:
        """Batched over requests; request i's anchor sits at position context_len(req_ids[i]).

        forced_tokens [R, gamma]: teacher forcing (tests, evaluation): use these as x_1..x_gamma
        instead of sampling, so later slots are conditioned on them.
        """
        raise NotImplementedError
