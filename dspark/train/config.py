"""The training recipe, typed: what a config file's "train" section may say, with its defaults.

    {"drafter": {"kind": "dspark", ...DrafterConfig fields}, "target": optional, "train": {...}}

An unknown key or a value of the wrong type is a ValueError naming it, before anything runs.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from dspark.train import losses


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000  # optimiser steps (the budget)
    lr: float = 6e-4
    warmup_steps: int = 50  # linear warmup, then cosine decay to lr * min_lr_ratio
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    batch_sequences: int = 2  # sequences per optimiser step
    anchors_per_seq: int = 512  # reference anchor count per sequence (capped by the token budget)
    max_block_tokens: int = 2048  # budget of supervised rows (anchors x gamma, or EAGLE-3 rows) per step
    max_seq_len: int = 1024  # longer sequences are cropped to a random window
    slot_decay: float = 4.0  # w_k = exp(-(k-1)/slot_decay)
    mix: dict = field(default_factory=lambda: dict(losses.DEFAULT_MIX))  # CE / TV / confidence weights
    ttt_steps: int = 7  # EAGLE-3 training-time test
    ttt_decay: float = 0.8
    seed: int = 0
    save_every: int = 200
    eval_every: int = 0  # held-out loss every N steps (0: never; needs held-out sequences)
    eval_sequences: int = 16  # how many held-out sequences each evaluation reads (the same ones each time)
    keep_checkpoints: int = 2
    bf16: bool = False  # drafter forward/backward under CPU bf16 autocast (AMX); weights and AdamW stay fp32

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(values) - set(known)
        if unknown:
            raise ValueError(f"unknown train settings: {sorted(unknown)}")
        defaults, checked = cls(), {}
        for name, value in values.items():
            default = getattr(defaults, name)
            if not _fits(value, default):
                raise ValueError(f"train.{name} must be like {default!r}, got {value!r}")
            checked[name] = tuple(value) if isinstance(default, tuple) else value
        if isinstance(checked.get("mix"), dict) and set(checked["mix"]) - set(losses.DEFAULT_MIX):
            raise ValueError(f"train.mix: unknown terms {sorted(set(checked['mix']) - set(losses.DEFAULT_MIX))}")
        return cls(**checked)

    def to_dict(self) -> dict:
        return {name: list(v) if isinstance(v, tuple) else v for name, v in dataclasses.asdict(self).items()}


def _fits(value, default) -> bool:
    """Whether a JSON value can stand where `default` does (an int where a float goes, a list for a tuple)."""
    if isinstance(value, bool) != isinstance(default, bool):
        return False
    if isinstance(default, float):
        return isinstance(value, (int, float))
    if isinstance(default, tuple):
        return isinstance(value, (list, tuple)) and len(value) == len(default)
    return isinstance(value, type(default))


def load_train_config(config: str | Path | dict) -> dict:
    """{"drafter": dict, "target": str | None, "train": TrainConfig} from a JSON file or a dict."""
    cfg = json.loads(Path(config).read_text()) if not isinstance(config, dict) else json.loads(json.dumps(config))
    unknown = set(cfg) - {"drafter", "target", "train"}
    if unknown:
        raise ValueError(f"unknown config sections: {sorted(unknown)}")
    if "kind" not in cfg.get("drafter", {}):
        raise ValueError('the config needs drafter.kind ("dspark", "dflash" or "eagle3")')
    cfg["train"] = TrainConfig.from_dict(cfg.get("train", {}))
    return cfg
