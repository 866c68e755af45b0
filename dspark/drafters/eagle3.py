"""EAGLE-3 baseline: one decoder layer drafting autoregressively (method.md 3).

Input at position i: u_i = fc([norm(g_i); embed(x_{i+1})]) with g_i = fuse([H^(l1); ...; H^(lm)])
for decided positions, and for later draft steps the layer's own previous output in place of g.
The output at position i predicts x_{i+2}. Attention is causal over the layer's own keys.

The per-request cache keeps the fused g and token of every context position and the layer's
keys/values of the positions whose next token is decided (the last one needs the anchor).
Draft steps past the anchor are speculative: their keys live only inside one `draft` call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.drafters.base import DraftBlock, Drafter
from dspark.drafters.context import ContextCache
from dspark.models.layers import RMSNorm, Rotary, SwiGLU, apply_rotary


class _CausalLayer(nn.Module):
    """A decoder layer whose attention is done by the caller (cache at inference, TTT in training)."""

    def __init__(self, cfg):
        super().__init__()
        d, self.heads, self.kv_heads, self.head_dim = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.input_layernorm = RMSNorm(d, cfg.rms_eps)
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_eps)
        self.mlp = SwiGLU(d, cfg.intermediate_size)

    def project(self, u, cos, sin):
        """u [N, d] -> q [N, H, hd], k/v [N, KV, hd] (rotated at their positions)."""
        h = self.input_layernorm(u)
        q = self.q_proj(h).view(-1, self.heads, self.head_dim)
        k = self.k_proj(h).view(-1, self.kv_heads, self.head_dim)
        v = self.v_proj(h).view(-1, self.kv_heads, self.head_dim)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def finish(self, u, attn):
        """attn [N, H, hd] -> the layer output [N, d]."""
        x = u + self.o_proj(attn.reshape(u.shape[0], -1))
        return x + self.mlp(self.post_attention_layernorm(x))

    def expand(self, kv):  # [..., KV, N, hd] -> [..., H, N, hd]
        return kv.repeat_interleave(self.heads // self.kv_heads, dim=-3)


def _shift(x: torch.Tensor, s: int) -> torch.Tensor:
    """Rows p of [.., P, hd] take row p - s (zeros before the start)."""
    if s == 0:
        return x
    return torch.cat([x.new_zeros(*x.shape[:-2], s, x.shape[-1]), x[..., :-s, :]], dim=-2)


class Eagle3Drafter(Drafter):
    def __init__(self, cfg, embed_weight, lm_head_weight, draft_vocab=None):
        super().__init__(cfg, embed_weight, lm_head_weight, draft_vocab)
        cfg, d = self.cfg, self.cfg.hidden_size
        self.fuse = nn.Linear(cfg.num_ctx_layers * d, d, bias=False)
        self.g_norm = RMSNorm(d, cfg.rms_eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layer = _CausalLayer(cfg)
        self.norm = RMSNorm(d, cfg.rms_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, None, 4096)
        self.ctx_tokens = ContextCache()
        self.kv = ContextCache()  # [2, KV, hd] per position whose next token is decided
        self._kv_next_token: dict[str, int] = {}  # the token the last cached key was built with

    def layer_input(self, g: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.g_norm(g), self.embed(next_tokens)], dim=-1))

    # ---- training: "training-time test" ----
    def train_forward(self, features: torch.Tensor, tokens: torch.Tensor, num_steps: int) -> torch.Tensor:
        """Unrolled drafting over every position of one sequence (teacher-forced tokens, own hidden).

        Returns final-normed hidden [num_steps, P, d] with P = L - 1: row p of step j sits at
        position p, was fed the step j-1 output of position p-1 (step 0: the target's g_p), and
        predicts x_{p+2} (target distribution from final_hidden[p+1]); valid for p >= j.
        Step j's query at p sees step-0 keys at positions <= p - j (the decided prefix of its
        chain) and the keys of steps 1..j at positions p-j+1..p (its own earlier draft steps).
        """
        P = tokens.shape[0] - 1
        positions = torch.arange(P, device=tokens.device)
        cos, sin = self.rotary.cos_sin(positions)
        g0 = self.fuse(features[:P].float())
        next_tokens = tokens[1:]
        keys, values, outputs, prev = [], [], [], None
        scale = self.cfg.head_dim ** -0.5
        for j in range(num_steps):
            g = g0 if j == 0 else _shift(prev, 1)
            u = self.layer_input(g, next_tokens)
            q, k, v = self.layer.project(u, cos, sin)
            q = q.transpose(0, 1)  # [H, P, hd]
            keys.append(self.layer.expand(k.transpose(0, 1))), values.append(self.layer.expand(v.transpose(0, 1)))
            s0 = (q @ keys[0].transpose(1, 2)) * scale
            s0 = s0.masked_fill(~(positions[None, :] <= positions[:, None] - j), float("-inf"))
            own = [(q * _shift(keys[t], j - t)).sum(-1) * scale for t in range(1, j + 1)]  # [H, P] each
            probs = torch.softmax(torch.cat([s0] + [s[..., None] for s in own], dim=-1), dim=-1)
            out = probs[..., :P] @ values[0]
            for t in range(1, j + 1):
                out = out + probs[..., P + t - 1, None] * _shift(values[t], j - t)
            prev = self.layer.finish(u, out.transpose(0, 1))
            outputs.append(self.norm(prev))
        return torch.stack(outputs)

    # ---- context cache ----
    @torch.no_grad()
    def extend_context(self, req_id: str, features: torch.Tensor, tokens: torch.Tensor) -> None:
        if features.shape[0] != tokens.shape[0]:
            raise ValueError(f"{features.shape[0]} feature rows for {tokens.shape[0]} tokens")
        if features.shape[0] == 0:
            return
        n = self.context_len(req_id)
        if self.kv.length(req_id) == n and n > 0 and self._kv_next_token.get(req_id) != int(tokens[0]):
            self.kv.truncate(req_id, n - 1)  # the last key assumed a different next token
        device = self.lm_head_draft.device
        self.contexts.append(req_id, self.fuse(features.to(device).float()))
        self.ctx_tokens.append(req_id, tokens.to(device).long())

    def rollback(self, req_id: str, n_ctx: int) -> None:
        if n_ctx < self.context_len(req_id):
            # The key of position n_ctx-1 was built with token n_ctx, which may now change.
            self.kv.truncate(req_id, min(self.kv.length(req_id), max(n_ctx - 1, 0)))
        self.contexts.truncate(req_id, n_ctx)
        self.ctx_tokens.truncate(req_id, n_ctx)

    def release(self, req_id: str) -> None:
        for cache in (self.contexts, self.ctx_tokens, self.kv):
            cache.release(req_id)
        self._kv_next_token.pop(req_id, None)

    def _catch_up(self, req_id: str, anchor: int) -> torch.Tensor:
        """Build the keys of context positions still missing them; return the output at position n-1."""
        n = self.context_len(req_id)
        if n == 0:
            raise ValueError(f"EAGLE-3 needs at least one context position to draft for {req_id!r}")
        have = min(self.kv.length(req_id), n - 1)  # always recompute n-1: it is the first draft step
        self.kv.truncate(req_id, have)
        toks = self.ctx_tokens.rows(req_id)
        next_tokens = torch.cat([toks[have + 1:n], torch.tensor([anchor], device=toks.device)])
        positions = torch.arange(have, n, device=toks.device)
        cos, sin = self.rotary.cos_sin(positions)
        u = self.layer_input(self.contexts.rows(req_id)[have:n], next_tokens)
        q, k, v = self.layer.project(u, cos, sin)
        self.kv.append(req_id, torch.stack([k, v], dim=1))
        self._kv_next_token[req_id] = anchor
        cached = self.kv.rows(req_id)  # [n, 2, KV, hd]
        keys, vals = self.layer.expand(cached[:, 0].transpose(0, 1)), self.layer.expand(cached[:, 1].transpose(0, 1))
        causal = torch.arange(n, device=toks.device)[None, :] <= positions[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, vals, attn_mask=causal)
        return self.layer.finish(u, out.transpose(0, 1))[-1]

    # ---- drafting ----
    @torch.no_grad()
    def draft(self, req_ids, anchors, temperatures, generators, forced_tokens=None, return_logits=False):
        cfg = self.cfg
        anchors = anchors.long()
        device = self.lm_head_draft.device
        prev_out = torch.stack([self._catch_up(r, int(a)) for r, a in zip(req_ids, anchors)])  # step 1 at n-1
        like = torch.empty(0, 2, cfg.num_kv_heads, cfg.head_dim, device=device)
        cached, valid = self.kv.padded(req_ids, like)  # [R, L, 2, KV, hd]
        keys = self.layer.expand(cached[:, :, 0].transpose(1, 2))  # [R, H, L, hd]
        vals = self.layer.expand(cached[:, :, 1].transpose(1, 2))
        starts = torch.tensor([self.context_len(r) for r in req_ids], device=device)
        tokens, ids, probs, all_logits = [], [], [], []
        for k in range(self.gamma):
            if k > 0:  # draft step k+1 at position n+k-1, fed its own previous output and x_k
                u = self.layer_input(prev_out, tokens[-1])
                cos, sin = self.rotary.cos_sin(starts + k - 1)
                q, key, val = self.layer.project(u, cos, sin)
                keys = torch.cat([keys, self.layer.expand(key[:, :, None])], dim=2)
                vals = torch.cat([vals, self.layer.expand(val[:, :, None])], dim=2)
                valid = torch.cat([valid, torch.ones(len(req_ids), 1, dtype=torch.bool, device=device)], dim=1)
                out = F.scaled_dot_product_attention(q[:, :, None], keys, vals, attn_mask=valid[:, None, None, :])
                prev_out = self.layer.finish(u, out[:, :, 0])
            logits = self.draft_logits(self.norm(prev_out))
            forced = forced_tokens[:, k] if forced_tokens is not None else None
            tok, slot_ids, slot_probs = self.sample_slot(logits, temperatures, generators, forced)
            tokens.append(tok), ids.append(slot_ids), probs.append(slot_probs), all_logits.append(logits)
        return DraftBlock(tokens=torch.stack(tokens, 1), conf_logits=None,
                          support_ids=torch.stack(ids, 1), support_probs=torch.stack(probs, 1).float(),
                          logits=torch.stack(all_logits, 1).float() if return_logits else None)
