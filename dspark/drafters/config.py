"""DrafterConfig: plain data describing one drafter (saved as config.json next to its weights)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from dspark.models.config import ModelConfig

KINDS = ("dspark", "dflash", "eagle3")
HEADS = ("markov", "rnn", None)
TOKEN_TABLES = ("full", "compact")


@dataclass
class DrafterConfig:
    kind: str  # "dspark" | "dflash" | "eagle3"
    hidden_size: int  # d, the target's width (the embedding and LM head are the target's)
    vocab_size: int  # V of the target
    ctx_layers: list[int]  # target decoder layers whose outputs form the context features
    num_layers: int = 2  # drafter decoder layers (EAGLE-3 always uses 1)
    num_heads: int = 0  # 0 = the target's
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    gamma: int = 7  # block size: draft tokens per block
    head: str | None = "markov"  # DSpark sequential head: "markov" | "rnn" | None
    markov_rank: int = 256  # r of W1 (V x r) and W2 (r x V')
    markov_table: str = "full"  # W1: "full" (V x r) | "compact" (V' x r + a d x r projection; heads.py)
    confidence: bool = True  # DSpark confidence head
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    draft_vocab_size: int | None = None  # draft only the N most frequent target tokens (None = all V)
    support_size: int = 8  # S of the compact exact q at temperature > 0
    target: str = ""
    version: str = "0"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {self.head!r}")
        if self.markov_table not in TOKEN_TABLES:
            raise ValueError(f"markov_table must be one of {TOKEN_TABLES}, got {self.markov_table!r}")
        if self.kind != "dspark":  # the baselines have no sequential or confidence head
            self.head, self.confidence = None, False
        if self.kind == "eagle3":
            self.num_layers = 1
        self.ctx_layers = list(self.ctx_layers)

    @property
    def num_ctx_layers(self) -> int:
        return len(self.ctx_layers)

    @property
    def draft_vocab(self) -> int:
        """V': how many tokens the drafter can propose."""
        return self.draft_vocab_size or self.vocab_size

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> DrafterConfig:
        known = {f.name for f in fields(DrafterConfig)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown DrafterConfig fields: {sorted(unknown)}")
        return DrafterConfig(**d)

    @staticmethod
    def for_target(target_cfg: ModelConfig, kind: str, ctx_layers: list[int], **overrides) -> DrafterConfig:
        """Defaults taken from the target: width, heads, MLP size, RoPE base."""
        base = dict(kind=kind, hidden_size=target_cfg.hidden_size, vocab_size=target_cfg.vocab_size,
                    ctx_layers=list(ctx_layers), num_heads=target_cfg.num_heads,
                    num_kv_heads=target_cfg.num_kv_heads, head_dim=target_cfg.head_dim,
                    intermediate_size=target_cfg.intermediate_size, rope_theta=target_cfg.rope_theta,
                    rms_eps=target_cfg.rms_eps)
        base.update(overrides)
        return DrafterConfig(**base)

    def resolved(self) -> DrafterConfig:
        """Fill the 0 (= "the target's") shape fields that for_target did not set."""
        d = self.to_dict()
        d["num_heads"] = self.num_heads or max(1, self.hidden_size // 64)
        d["num_kv_heads"] = self.num_kv_heads or d["num_heads"]
        d["head_dim"] = self.head_dim or self.hidden_size // d["num_heads"]
        d["intermediate_size"] = self.intermediate_size or 4 * self.hidden_size
        return DrafterConfig(**d)

