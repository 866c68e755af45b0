"""Target model configuration: one dataclass for the Llama, Qwen2 and Qwen3 decoder families."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias)
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_hf(cfg: dict) -> ModelConfig:
        """Build from a Hugging Face config.json dict (transformers v4 and v5 layouts)."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "qwen2", "qwen3", "mistral"):
            raise ValueError(f"unsupported model_type {model_type!r} (llama, qwen2, qwen3)")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        # transformers v5 moved rope settings into rope_parameters.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        bias = bool(cfg.get("attention_bias", False))
        return ModelConfig(
            arch="llama" if model_type == "mistral" else model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else bias,
            o_bias=bias if model_type == "llama" else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def spread_layers(num_layers: int, count: int = 5) -> list[int]:
    """Context layers spread over the depth, never the last (method.md 2: e.g. 1, 9, .., 33 of 36)."""
    if num_layers < 2:
        return [0]
    count = min(count, num_layers - 1)
    # The reference spacing ends 3 layers before the top (33 of 36); small models stretch to L-2.
    first = min(1, num_layers - 2)
    last = min(max(num_layers - 3, first + count - 1), num_layers - 2)
    if count == 1:
        return [last]
    step = (last - first) / (count - 1)
    return sorted({round(first + i * step) for i in range(count)})
