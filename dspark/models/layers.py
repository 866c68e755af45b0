"""Building blocks shared by the target model and the drafters: RMSNorm, RoPE, SwiGLU."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dspark.kernels.cpu import kernels
from dspark.models.precision import GgufBlocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementations, then cast back.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            ops = kernels() if x.device.type == "cpu" and not torch.is_grad_enabled() else None
            if ops is not None:
                return ops.rms_norm(x, self.weight, self.eps)  # one call, not six tiny ops
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def fuse_linears(*linears: nn.Linear) -> nn.Linear:
    """One nn.Linear whose output is the given ones' outputs concatenated (same input)."""
    first = linears[0]
    fused = nn.Linear(first.in_features, sum(p.out_features for p in linears), bias=first.bias is not None,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in linears]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in linears]))
    fused.gguf_blocks = GgufBlocks.concat([getattr(p, "gguf_blocks", None) for p in linears])
    return fused


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def fuse_projections(self) -> None:
        """One gate|up matmul instead of two (serving only: the checkpoint layout stays HF's)."""
        if hasattr(self, "gate_up_proj"):
            return
        self.gate_up_proj = fuse_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention factor for the rope variants these configs use."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv.float(), 1.0
    kind = scaling.get("rope_type", "default")
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return (inv / factor).float(), 1.0
    if kind == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(medium, smoothed, scaled).float(), 1.0
    if kind == "yarn":
        old = scaling.get("original_max_position_embeddings") or max_position
        attn = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
        beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo = max(math.floor(correction_dim(beta_fast)), 0)
        hi = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
        keep = 1 - ramp  # share of the original (extrapolated) frequency
        return (inv / factor * (1 - keep) + inv * keep).float(), float(attn)
    raise ValueError(f"unsupported rope_type {kind!r}")


class Rotary(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by absolute position."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_position: int):
        super().__init__()
        inv, attn_factor = rope_inv_freq(head_dim, theta, scaling, max_position)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.attn_factor = attn_factor
        self._table_len = 0

    def _table(self, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if length > self._table_len or self._cos.device != device:
            length = max(length, 2 * self._table_len, 256)
            t = torch.arange(length, device=device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.to(device))
            emb = torch.cat([freqs, freqs], dim=-1)
            self._cos, self._sin = emb.cos() * self.attn_factor, emb.sin() * self.attn_factor
            self._signed_sin = rope_tables(self._cos, self._sin)[1][:, 0]
            self._table_len = length
        return self._cos, self._sin

    def cos_sin(self, positions: torch.Tensor, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """length: a bound on positions + 1 when the caller knows it (saves a device->host sync)."""
        if length is None:
            length = int(positions.max()) + 1 if positions.numel() else 1
        cos, sin = self._table(length, positions.device)
        return cos[positions], sin[positions]

    def rope_rows(self, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin) [N, hd] at positions (each < length), as the CPU kernels take them: what
        rope_tables makes of cos_sin's, from a signed table made once, not a cat and a negation a call."""
        cos, _ = self._table(length, positions.device)
        return cos[positions], self._signed_sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim]; cos/sin [N, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos [N, hd] and sin [N, hd] as apply_rope wants them: [N, 1, hd], sin's first half negated."""
    half = sin.shape[-1] // 2
    return cos[:, None, :], torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary in three ops, for tables from rope_tables: rotate-half is a roll by half with
    the sign folded into sin. x [N, heads, head_dim]."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)
