"""Drafter checkpoints: a directory with config.json and model.safetensors (docs/drafter_format.md).

The target's embedding and LM head are not stored: loading needs them passed in, and refuses
a target whose shapes differ from the one the drafter was trained for.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark.drafters import build_drafter
from dspark.drafters.base import Drafter
from dspark.drafters.config import DrafterConfig

FORMAT_VERSION = 1


def save_drafter(drafter: Drafter, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json and model.safetensors (floating tensors in `dtype`; ids stay int64)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: (t.to(dtype) if t.is_floating_point() else t).contiguous().cpu()
             for name, t in drafter.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format_version": str(FORMAT_VERSION)})
    config = {"format_version": FORMAT_VERSION, **drafter.cfg.to_dict()}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def load_config(directory: str | Path) -> DrafterConfig:
    raw = json.loads((Path(directory) / "config.json").read_text())
    version = raw.pop("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise ValueError(f"drafter format version {version} is not supported (expected {FORMAT_VERSION})")
    return DrafterConfig.from_dict(raw)


def load_drafter(directory: str | Path, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> Drafter:
    """Rebuild the drafter in float32 for the given target weights (both [V, d])."""
    cfg = load_config(directory)
    state = load_file(str(Path(directory) / "model.safetensors"))
    drafter = build_drafter(cfg, embed_weight, lm_head_weight, draft_vocab=state["draft_vocab"])
    drafter.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in state.items()})
    return drafter.eval()


def load_calibration(directory: str | Path, version: str) -> list[float] | None:
    """The offline STS temperatures shipped next to the checkpoint (calibration.json, written by
    `python -m dspark.train.calibrate`), or None: absent, or fitted for another drafter version."""
    path = Path(directory) / "calibration.json"
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    if raw.get("drafter_version") != version:
        return None
    return [float(t) for t in raw["temperatures"]]
