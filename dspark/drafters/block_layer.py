"""The parallel backbone's decoder layer: a draft block attends to context features plus itself.

Each layer projects the context states H_ctx with its own k/v weights (method.md 2). A block
sees the context positions strictly before its anchor and every row of its own block
(bidirectional). Training runs many blocks of one sequence at once over a shared context;
inference runs one block per request over that request's cached context. Both are the same
call: blocks come in groups [G, n] that share one context of L positions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.drafters.config import DrafterConfig
from dspark.kernels.cpu import kernels
from dspark.models.layers import RMSNorm, SwiGLU, apply_rotary, fuse_linears


def block_attention(q, k_ctx, v_ctx, ctx_visible, k_blk, v_blk) -> torch.Tensor:
    """One softmax over [visible context keys ; the block's own keys].

    q, k_blk, v_blk [G, n, H, g, hd]; k_ctx, v_ctx [G, KV, L, hd] with KV dividing H (query head h
    reads kv head h // (H / KV)); ctx_visible [G, n, L] bool. Returns [G, n, H, g, hd]. The query
    heads that share a kv head are stacked as rows of one matmul against it, so the context is
    never copied per query head, and the two key sets apart, so never once per block.
    """
    G, n, H, g, hd = q.shape
    KV, L = k_ctx.shape[1], k_ctx.shape[2]
    scale = hd ** -0.5
    q_grouped = q.reshape(G, n, KV, (H // KV) * g, hd)
    s_ctx = torch.einsum("gnkqd,gkld->gnkql", q_grouped, k_ctx).reshape(G, n, H, g, L) * scale
    s_ctx = s_ctx.masked_fill(~ctx_visible[:, :, None, None, :], float("-inf"))
    s_blk = torch.einsum("gnhqd,gnhkd->gnhqk", q, k_blk) * scale
    probs = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)
    p_ctx, p_blk = probs.split([L, s_blk.shape[-1]], dim=-1)
    out_ctx = torch.einsum("gnkql,gkld->gnkqd", p_ctx.reshape(G, n, KV, (H // KV) * g, L), v_ctx)
    return out_ctx.reshape(G, n, H, g, hd) + torch.einsum("gnhqk,gnhkd->gnhqd", p_blk, v_blk)


def draft_attention(q, k_ctx, v_ctx, ctx_visible, k_blk, v_blk) -> torch.Tensor:
    """block_attention with one block per request, as one scaled_dot_product_attention call.

    q [R, H, g, hd]; k_ctx, v_ctx [R, KV, L, hd]; ctx_visible [R, L] bool; k_blk, v_blk [R, KV, g, hd].
    Returns [R, H, g, hd]. The same softmax over [visible context ; the block] (query head h reads kv
    head h // (H / KV)) in ~5 ops where the einsum form takes ~40: a draft's attention is a few rows.
    """
    keys, values = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
    mask = None
    if not bool(ctx_visible.all()):  # padded rows of shorter contexts, or context a block may not see
        block = ctx_visible.new_ones(ctx_visible.shape[0], k_blk.shape[2])
        mask = torch.cat([ctx_visible, block], dim=1)[:, None, None, :]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


class BlockDecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        d, self.heads, self.kv_heads, self.head_dim = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.input_layernorm = RMSNorm(d, cfg.rms_eps)
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_eps)
        self.mlp = SwiGLU(d, cfg.intermediate_size)

    def fuse_projections(self) -> None:
        """Serving: q|k|v of block rows in one matmul and k|v of context rows in one, instead of three
        and two (a draft's matmuls are a few rows each: the calls, not the products, cost). The
        checkpoint keeps the separate layout; training never fuses."""
        if hasattr(self, "qkv_proj"):
            return
        self.qkv_proj = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        self.kv_proj = fuse_linears(self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def _project(self, h: torch.Tensor, query: bool) -> list[torch.Tensor]:
        """[q,] k, v of rows h: [N, heads or kv heads, hd] each."""
        n, hd = h.shape[0], self.head_dim
        heads = ([self.heads] if query else []) + [self.kv_heads, self.kv_heads]
        if hasattr(self, "qkv_proj"):
            fused = (self.qkv_proj if query else self.kv_proj)(h)
            parts = fused.split([x * hd for x in heads], dim=-1)
        else:
            parts = ([self.q_proj(h)] if query else []) + [self.k_proj(h), self.v_proj(h)]
        return [p.reshape(n, x, hd) for p, x in zip(parts, heads)]

    def context_kv(self, h_ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """This layer's keys (rotated at their true positions) and values of H_ctx rows: [L, KV, hd] each."""
        k, v = self._project(h_ctx, query=False)
        return apply_rotary(k, cos, sin), v

    def stack_parts(self) -> tuple | None:
        """What dspark.models.transformer.layer_stack takes of a layer (cached_forward's kernels, in its
        order); None before fuse_projections."""
        if not (hasattr(self, "qkv_proj") and hasattr(self.mlp, "gate_up_proj")):
            return None
        return (self.input_layernorm, self.qkv_proj, self.o_proj, self.post_attention_layernorm,
                self.mlp.gate_up_proj, self.mlp.down_proj, self.heads)

    def cached_forward(self, x, delta, rope, k_cache, v_cache, where):
        """Drafting on the CPU kernels (after fuse_projections), as the target's fused layer: adds the
        previous layer's output `delta` to the block rows x [N, d] in place and returns this layer's
        MLP output. rope: (cos, signed_sin) [N, 1, hd]; k_cache/v_cache [slots, KV, capacity, hd];
        where: per row (slot, position its key and value are written at, keys it attends to)."""
        ops, n = kernels(), x.shape[0]
        h = ops.add_rms_norm(x, delta, self.input_layernorm.weight, self.input_layernorm.eps, False)
        slots, positions, keys = where
        h = ops.rope_cache_attention(self.qkv_proj(h), rope[0].view(n, -1), rope[1].view(n, -1), k_cache, v_cache,
                                     slots, positions, self.heads, False, keys)
        h = ops.add_rms_norm(x, self.o_proj(h), self.post_attention_layernorm.weight,
                             self.post_attention_layernorm.eps, False)
        return self.mlp.down_proj(ops.silu_mul(self.mlp.gate_up_proj(h), False))

    def _expand_heads(self, kv: torch.Tensor) -> torch.Tensor:
        return kv.repeat_interleave(self.heads // self.kv_heads, dim=-3)

    def forward(self, x, cos, sin, k_ctx, v_ctx, ctx_visible):
        """x [G, n, g, d]; cos/sin [G, n, g, hd]; k_ctx/v_ctx [G, KV, L, hd]; ctx_visible [G, n, L]."""
        G, n, g, d = x.shape
        h = self.input_layernorm(x).reshape(-1, d)
        cos, sin = cos.reshape(-1, self.head_dim), sin.reshape(-1, self.head_dim)
        q, k, v = self._project(h, query=True)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        def blocks(t):  # [G*n*g, heads, hd] -> [G, n, heads, g, hd]
            return t.view(G, n, g, -1, self.head_dim).transpose(2, 3)

        if n == 1 and not torch.is_grad_enabled():  # drafting: one block per request, a fused kernel
            q1, k1, v1 = (blocks(t)[:, 0] for t in (q, k, v))
            out = draft_attention(q1, k_ctx, v_ctx, ctx_visible[:, 0], k1, v1)[:, None]
        else:
            k_blk, v_blk = self._expand_heads(blocks(k)), self._expand_heads(blocks(v))
            out = block_attention(blocks(q), k_ctx, v_ctx, ctx_visible, k_blk, v_blk)
        out = out.transpose(2, 3).reshape(G, n, g, self.heads * self.head_dim)
        x = x + self.o_proj(out)
        return x + self.mlp(self.post_attention_layernorm(x))
