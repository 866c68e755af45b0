"""Llama / Qwen2 / Qwen3 decoder in plain torch, run over flattened varlen batches.

Parameter names follow the Hugging Face layout so checkpoints load without renaming.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark.engine.batch import VarlenBatch
from dspark.engine.kv_cache import KVCache
from dspark.models.config import ModelConfig
from dspark.models.layers import RMSNorm, Rotary, SwiGLU, apply_rotary


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [N, d] final-normed hidden state of every new token
    logits: torch.Tensor | None  # [len(logits_rows), V] float32
    features: torch.Tensor | None  # [N, m*d] outputs of the captured layers, concatenated


def _attend(q, k, v, first_pos: int) -> torch.Tensor:
    """q [H, n, hd] at positions first_pos.. attends causally to k/v [KV, c, hd] at positions 0..c-1."""
    n, c = q.shape[1], k.shape[1]
    if n == 1:  # a decode token sees its whole context: no mask, GQA handled by SDPA
        return F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True)[0]
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)  # SDPA's GQA path is slow with masks on CPU
    if first_pos == 0 and n == c:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = torch.arange(c, device=q.device)[None, :] <= (first_pos + torch.arange(n, device=q.device))[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_eps)

    def forward(self, x, cos, sin, batch: VarlenBatch, cache: KVCache | None):
        n_tokens = x.shape[0]
        q = self.q_proj(x).view(n_tokens, self.heads, self.head_dim)
        k = self.k_proj(x).view(n_tokens, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(n_tokens, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # heads first
        out = torch.empty_like(q)
        row = 0
        # One attention call per sequence on views of its cache slot: no gathers or padding.
        for b, (start, n) in enumerate(zip(batch.starts, batch.lens)):
            rows = slice(row, row + n)
            if cache is None:
                out[:, rows] = _attend(q[:, rows], k[:, rows], v[:, rows], 0)
            else:
                slot = batch.slot_list[b]
                kc, vc = cache.k[self.layer_idx][slot], cache.v[self.layer_idx][slot]
                kc[:, start:start + n] = k[:, rows].to(kc.dtype)
                vc[:, start:start + n] = v[:, rows].to(vc.dtype)
                keys, values = kc[:, :start + n].to(q.dtype), vc[:, :start + n].to(q.dtype)
                out[:, rows] = _attend(q[:, rows], keys, values, start)
            row += n
        return self.o_proj(out.transpose(0, 1).reshape(n_tokens, self.heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x, cos, sin, batch, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)

    def tie_weights(self) -> None:
        # Re-run after to_empty()/to(): those can give the two modules separate copies.
        if self.config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, max_slots: int, max_len: int, dtype=None) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_layers, max_slots, max_len, cfg.num_kv_heads, cfg.head_dim,
                       dtype=dtype or self.dtype, device=self.lm_head.weight.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def forward(self, batch: VarlenBatch, cache: KVCache | None = None,
                capture_layers: tuple[int, ...] | list[int] = (),
                logits_rows: torch.Tensor | str | None = "last") -> ForwardOutput:
        """One pass over a varlen batch.

        logits_rows: "last" (each sequence's last new token), "all", None, or flat row indices.
        capture_layers: decoder layers whose outputs are returned concatenated (drafter features).
        """
        if cache is not None:
            ends = [s + n for s, n in zip(batch.starts, batch.lens)]
            if max(ends) > cache.max_len:
                raise ValueError(f"sequence of {max(ends)} tokens exceeds the KV cache length {cache.max_len}")
        cos, sin = self.rotary.cos_sin(batch.positions)
        x = self.model.embed_tokens(batch.tokens)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        captured = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, batch, cache)
            if i in capture_layers:
                captured[i] = x
        if cache is not None:
            for slot, end in zip(batch.slot_list, ends):
                cache.lengths[slot] = end
        hidden = self.model.norm(x)
        if isinstance(logits_rows, str):
            logits_rows = batch.last_rows() if logits_rows == "last" else torch.arange(hidden.shape[0])
        logits = self.logits(hidden[logits_rows]) if logits_rows is not None else None
        features = torch.cat([captured[i] for i in capture_layers], dim=-1) if capture_layers else None
        return ForwardOutput(hidden=hidden, logits=logits, features=features)
