"""Llama / Qwen2 / Qwen3 decoder in plain torch, run over flattened varlen batches.

Parameter names follow the Hugging Face layout so checkpoints load without renaming.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark.device import host_values
from dspark.kernels.cpu import kernels
from dspark.models.batch import VarlenBatch
from dspark.models.config import ModelConfig
from dspark.models.kv_cache import KVCache
from dspark.models.layers import RMSNorm, Rotary, SwiGLU, apply_rope, fuse_linears, rope_tables
from dspark.models.precision import GgufLinear, Int8Linear, apply_precision
from dspark.models.threads import one_thread


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [N, d] final-normed hidden state of every new token
    logits: torch.Tensor | None  # [len(logits_rows), V] float32 (None when only the argmax was asked for)
    features: torch.Tensor | None  # [N, m*d] outputs of the captured layers, concatenated
    tokens: torch.Tensor | None = None  # [len(logits_rows)] argmax of each of those rows' logits (greedy)


KEY_BUCKET = 64  # a cached row attends to its keys padded to a multiple of this (masked)


@dataclass
class RowGroup:
    """New rows of one sequence whose positions fall in the same key bucket: one attention call."""
    rows: slice  # in the flattened batch
    keys: int  # keys every row of the group reads (its bucket's end, at most the cache length)
    mask: torch.Tensor  # [n, 1, 1, keys] additive: row j sees keys <= its position


@dataclass
class SeqAttention:
    slot: int
    prefill: bool  # no cache (training, scoring): causal attention among its own rows
    rows: slice
    groups: list[RowGroup]


@dataclass
class AttentionPlan:
    """What every layer's attention needs to know of a varlen batch, worked out once per pass."""
    seqs: list[SeqAttention]
    write_slots: torch.Tensor  # [N] slot and position of each new token: one cache write per layer
    write_positions: torch.Tensor
    cached_kernel: bool  # every row attends its cache through dspark.kernels (CPU), not SDPA


def row_groups(first_row: int, start: int, n: int, cache_len: int, device) -> list[RowGroup]:
    """Rows at positions start..start+n-1, grouped by key bucket. The keys a row reads and its mask
    depend only on its position, so a row verified in a block and the same row decoded alone make
    the same call and get the same bits: speculation stays exactly plain decoding's output."""
    groups, j = [], 0
    while j < n:
        keys = min(((start + j) // KEY_BUCKET + 1) * KEY_BUCKET, cache_len)
        count = min(n - j, keys - (start + j))
        positions = start + j + torch.arange(count, device=device)
        hidden = torch.arange(keys, device=device)[None, :] > positions[:, None]
        mask = torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf"))[:, None, None]
        groups.append(RowGroup(slice(first_row + j, first_row + j + count), keys, mask))
        j += count
    return groups


def plan_attention(batch: VarlenBatch, cache: KVCache | None, cached_kernel: bool) -> AttentionPlan:
    """cached_kernel: the C++ kernel attends every cached row (it needs no groups or masks)."""
    seqs, row, device = [], 0, batch.tokens.device
    for slot, start, n in zip(batch.slot_list, batch.starts, batch.lens):
        # With a cache every row, a prompt's too, is computed as a lone decode row would be: a
        # request's bits then never depend on how its tokens were split into passes (a resumed
        # request re-reads what it streamed as one prompt).
        prefill = cache is None
        groups = [] if prefill or cached_kernel else row_groups(row, start, n, cache.max_len, device)
        seqs.append(SeqAttention(slot, prefill, slice(row, row + n), groups))
        row += n
    slots = host_values([slot for slot, n in zip(batch.slot_list, batch.lens) for _ in range(n)], torch.long, device)
    return AttentionPlan(seqs, slots, batch.positions, cached_kernel and cache is not None)


def _attend_group(q, kc, vc, group: RowGroup) -> torch.Tensor:
    """The group's rows q [n, H, hd] over the slot's first `keys` keys kc/vc [KV, L, hd], in one
    call of SDPA's fused CPU kernel (4-D inputs: 3-D ones take its slow path). Each row is a batch
    entry of its own, its KV head's H/KV query heads that entry's query rows, and K/V a broadcast
    view: so every row is computed exactly as a lone decode row is, whatever else the block holds.
    (Stacking a block's rows into one entry is faster, but on some CPUs a row's bits then depend
    on how many rows share the call; tests/test_precision.py checks.) Returns [n, H*hd]."""
    n, heads, hd = q.shape
    kv_heads = kc.shape[0]
    rows = q.view(n, kv_heads, heads // kv_heads, hd)
    keys = (n, kv_heads, group.keys, hd)
    out = F.scaled_dot_product_attention(rows, kc[None, :, :group.keys].expand(keys), vc[None, :, :group.keys].expand(keys),
                                         attn_mask=group.mask)
    return out.reshape(n, heads * hd)


def _attend_prefill(q, k, v) -> torch.Tensor:
    """Rows with no cache behind them: SDPA's causal flash path. q [n, H, hd], k/v [n, KV, hd]."""
    n, heads, hd = q.shape
    rep = heads // k.shape[1]
    k, v = k.transpose(0, 1).repeat_interleave(rep, 0), v.transpose(0, 1).repeat_interleave(rep, 0)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
    return out.transpose(0, 1).reshape(n, heads * hd)


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

    def fuse_projections(self) -> None:
        """One q|k|v matmul instead of three (serving only: the checkpoint layout stays HF's)."""
        if hasattr(self, "qkv_proj"):
            return
        self.qkv_proj = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def _qkv(self, x, rope):
        """Projected and rotated q [N, H, hd], k and v [N, KV, hd]."""
        n, heads, kv_heads, hd = x.shape[0], self.heads, self.kv_heads, self.head_dim
        if hasattr(self, "qkv_proj") and not hasattr(self, "q_norm"):
            qkv = self.qkv_proj(x)
            qk = apply_rope(qkv[:, :(heads + kv_heads) * hd].view(n, heads + kv_heads, hd), *rope)
            return qk[:, :heads], qk[:, heads:], qkv[:, (heads + kv_heads) * hd:].view(n, kv_heads, hd)
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(n, heads, hd), k.view(n, kv_heads, hd), v.view(n, kv_heads, hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, *rope), apply_rope(k, *rope), v

    def forward(self, x, rope, plan: AttentionPlan, cache: KVCache | None):
        q, k, v = self._qkv(x, rope)
        kc = vc = None
        if cache is not None:
            kc, vc = cache.k[self.layer_idx], cache.v[self.layer_idx]
            kc[plan.write_slots, :, plan.write_positions] = k.to(kc.dtype)  # the batch's new tokens in one write
            vc[plan.write_slots, :, plan.write_positions] = v.to(vc.dtype)
            if plan.cached_kernel:  # one call for every row of the batch, spread over all cores
                return self.o_proj(kernels().cached_attention(q, kc, vc, plan.write_slots, plan.write_positions))
        # SDPA's CPU kernel splits work by thread count, and on some CPUs the split changes a row's
        # bits: attention runs on one thread, so a process's thread count never changes the output.
        with one_thread(q.device):
            if len(plan.seqs) == 1:
                out = self._attend_one(plan.seqs[0], q, k, v, kc, vc)
            else:
                out = torch.empty(x.shape[0], self.heads * self.head_dim, dtype=q.dtype, device=q.device)
                # One attention call per sequence on views of its cache slot: no gathers, no padding,
                # and a sequence's result never depends on the rest of the batch.
                for seq in plan.seqs:
                    out[seq.rows] = self._attend_one(seq, q, k, v, kc, vc)
        return self.o_proj(out)

    @staticmethod
    def _attend_one(seq: SeqAttention, q, k, v, kc, vc):
        if seq.prefill:
            return _attend_prefill(q[seq.rows], k[seq.rows], v[seq.rows])
        parts = [_attend_group(q[g.rows], kc[seq.slot], vc[seq.slot], g) for g in seq.groups]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x, rope, plan, cache):
        x = x + self.self_attn(self.input_layernorm(x), rope, plan, cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    @property
    def fusable(self) -> bool:
        return (hasattr(self.self_attn, "qkv_proj") and not hasattr(self.self_attn, "q_norm")
                and hasattr(self.mlp, "gate_up_proj"))

    def stack_parts(self) -> tuple | None:
        """(input norm, q|k|v, o, post-attention norm, gate|up, down, heads) for layer_stack; None unfused."""
        if not self.fusable:
            return None
        attn, mlp = self.self_attn, self.mlp
        return (self.input_layernorm, attn.qkv_proj, attn.o_proj, self.post_attention_layernorm, mlp.gate_up_proj,
                mlp.down_proj, attn.heads)

    def fused_forward(self, x, delta, rope, plan, cache):
        """The layer as eight calls (dspark/kernels between the matmuls), for cached CPU passes:
        adds the previous layer's output `delta` to the residual stream x in place and returns this
        layer's MLP output, whose add the next call makes. Each matmul reads its kernel's dtype."""
        ops, n = kernels(), x.shape[0]
        norm1, qkv, o, norm2, gate_up, down, layer, heads, bf16 = self._fused_parts()
        h = ops.add_rms_norm(x, delta, norm1.weight, norm1.eps, bf16)
        h = ops.rope_cache_attention(qkv(h), rope[0].view(n, -1), rope[1].view(n, -1), cache.k[layer],
                                     cache.v[layer], plan.write_slots, plan.write_positions, heads, bf16)
        h = ops.add_rms_norm(x, o(h), norm2.weight, norm2.eps, bf16)
        return down(ops.silu_mul(gate_up(h), bf16))

    def _fused_parts(self) -> tuple:
        """What fused_forward calls, looked up once: at decode, nn.Module's attribute lookups and
        call machinery cost as much as a small kernel. Each matmul is its kernel's own-dtype entry
        (Bf16Linear.native: bf16 in and out), else the module's forward. Transformer.set_precision
        drops it."""
        parts = self.__dict__.get("_parts")
        if parts is None:
            attn, mlp = self.self_attn, self.mlp
            bf16 = getattr(attn.qkv_proj, "native_dtype", torch.float32) == torch.bfloat16

            def matmul(linear):
                return linear.native if hasattr(linear, "native") else linear.forward

            parts = (self.input_layernorm, matmul(attn.qkv_proj), matmul(attn.o_proj), self.post_attention_layernorm,
                     matmul(mlp.gate_up_proj), matmul(mlp.down_proj), attn.layer_idx, attn.heads, bf16)
            self.__dict__["_parts"] = parts
        return parts


def layer_stack(layers):
    """The layers as one kernels().LayerStack (dspark/kernels/layer_stack.cpp: a pass's layers in one
    call, the same kernels in the same order as fused_forward) when every matmul runs the int8 kernel
    (AVX-512 VNNI) or gguf-q8 on interleaved blocks (AVX2), else None."""
    ops = kernels()
    parts = [layer.stack_parts() for layer in layers]
    if ops is None or not hasattr(ops, "LayerStack") or not parts or None in parts:
        return None
    stack = ops.LayerStack()
    for norm1, qkv, o, norm2, gate_up, down, heads in parts:
        matmuls = [_stack_args(linear, ops) for linear in (qkv, o, gate_up, down)]
        if None in matmuls:
            return None
        qkv_args, o_args, gate_up_args, down_args = matmuls
        stack.add_layer(norm1.weight.detach(), norm1.eps, qkv_args, o_args, norm2.weight.detach(), norm2.eps,
                        gate_up_args, down_args, heads)
    return stack


def _stack_args(linear, ops) -> tuple | None:
    """A linear's kernel arguments as LayerStack takes them, None where its kernel is not one of the two."""
    if isinstance(linear, Int8Linear) and linear.kernel is not None:
        return linear.weight_blocks, linear.w_scale, linear.bias, linear.x_scale
    if isinstance(linear, GgufLinear) and linear.kernel is ops.gguf_linear_q8_interleaved:
        return linear.blocks.data, linear.blocks.qtype, linear.bias
    return None


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
        self.precision = "fp32"  # until set_precision
        self._fused_layers = False  # q|k|v and gate|up fused in every layer (set_precision)
        self._layer_stack = None  # the layers in one kernel call, on the int8 or gguf-q8 kernels (set_precision)
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)

    def tie_weights(self) -> None:
        # Re-run after to_empty()/to(): those can give the two modules separate copies.
        if self.config.tie_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_precision(self, precision: str, input_ranges: dict[str, torch.Tensor] | None = None) -> str:
        """Put the matmuls on `precision`'s kernels (dspark.models.precision); returns the concrete one.
        The LM head's float weight stays reachable as `output_weight` (drafters share it).
        input_ranges: the linears' calibrated input ranges, for int8's SmoothQuant scales
        (int8_smoothing.py; None: int8 without them)."""
        self._output_weight = self.output_weight
        self.precision = apply_precision(self, precision, input_ranges)
        for layer in self.model.layers:
            layer.__dict__.pop("_parts", None)
        # fusing projections happens only here: whether the fused layer path applies is known now
        self._fused_layers = all(layer.fusable for layer in self.model.layers)
        self._layer_stack = layer_stack(self.model.layers)
        return self.precision

    @property
    def output_weight(self) -> torch.Tensor:
        """The LM head's weight [V, d] in the checkpoint's float dtype, whatever kernel runs it."""
        return self.lm_head.weight if isinstance(self.lm_head, nn.Linear) else self._output_weight

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def cached_kernel(self) -> bool:
        """Cached rows attend through the C++ kernel: on CPU, wherever it builds."""
        return self.device.type == "cpu" and kernels() is not None

    @property
    def kv_dtype(self) -> torch.dtype:
        """bf16 keys and values under bf16 matmuls on CPU: half the bytes a pass reads from the
        cache (v is a bf16 matmul output already; k loses only its rotation's rounding). int8 keeps
        fp32: a bf16 cache there measured no faster through the services (docs/results.md, session 26)."""
        return torch.bfloat16 if self.precision == "bf16" and self.cached_kernel else self.dtype

    def new_cache(self, max_slots: int, max_len: int, dtype=None) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_layers, max_slots, max_len, cfg.num_kv_heads, cfg.head_dim,
                       dtype=dtype or self.kv_dtype, device=self.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """logits(hidden).argmax(-1), the same indices; the int8 LM head finds them without writing the logits."""
        if isinstance(self.lm_head, Int8Linear):
            return self.lm_head.argmax(hidden)
        return self.logits(hidden).argmax(dim=-1)

    @torch.no_grad()
    def forward(self, batch: VarlenBatch, cache: KVCache | None = None,
                capture_layers: tuple[int, ...] | list[int] = (),
                logits_rows: torch.Tensor | str | None = "last", greedy: bool = False) -> ForwardOutput:
        """One pass over a varlen batch.

        logits_rows: "last" (each sequence's last new token), "all", None, or flat row indices.
        greedy: only the argmax of those rows' logits is wanted (ForwardOutput.tokens, no logits).
        capture_layers: decoder layers whose outputs are returned concatenated (drafter features).
        """
        batch = batch.to(self.device)  # callers outside the engines may build on CPU
        ends = [s + n for s, n in zip(batch.starts, batch.lens)]
        if cache is not None and max(ends) > cache.max_len:
            raise ValueError(f"sequence of {max(ends)} tokens exceeds the KV cache length {cache.max_len}")
        cos, sin = self.rotary.cos_sin(batch.positions, max(ends))
        x = self.model.embed_tokens(batch.tokens)
        rope = rope_tables(cos.to(x.dtype), sin.to(x.dtype))
        captured = {}
        plan = plan_attention(batch, cache, self.cached_kernel)
        if plan.cached_kernel and self._fused_layers:
            if self._layer_stack is not None:  # the loop below in one C++ call
                n = x.shape[0]
                delta, rows = self._layer_stack.forward(x, rope[0].view(n, -1), rope[1].view(n, -1), cache.k, cache.v,
                                                        plan.write_slots, plan.write_positions, list(capture_layers))
                captured = dict(zip(capture_layers, rows))
            else:
                delta = None  # the last layer's output, not yet added to x
                for i, layer in enumerate(self.model.layers):
                    delta = layer.fused_forward(x, delta, rope, plan, cache)
                    if i in capture_layers:
                        captured[i] = x + delta  # a copy: x itself keeps changing in place
            hidden = kernels().add_rms_norm(x, delta, self.model.norm.weight, self.model.norm.eps, False)
        else:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, rope, plan, cache)
                if i in capture_layers:
                    captured[i] = x
            hidden = self.model.norm(x)
        if cache is not None:
            for slot, end in zip(batch.slot_list, ends):
                cache.advance(slot, end)
        if isinstance(logits_rows, str):
            logits_rows = batch.last_rows() if logits_rows == "last" else torch.arange(hidden.shape[0],
                                                                                      device=hidden.device)
        logits = tokens = None
        if logits_rows is not None:
            rows = hidden[logits_rows.to(hidden.device)]
            if greedy:
                tokens = self.greedy_tokens(rows)
            else:
                logits = self.logits(rows)
        features = torch.cat([captured[i] for i in capture_layers], dim=-1) if capture_layers else None
        return ForwardOutput(hidden=hidden, logits=logits, features=features, tokens=tokens)
