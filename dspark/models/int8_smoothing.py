"""SmoothQuant scales for the int8 kernels: move activation outliers into the weights.

int8 quantizes each activation row on its own max |x|. A few inputs of a linear (the same few on every
token) run far larger than the rest, so they set the row's scale and the others keep only a few of
their 8 bits. Dividing input j by s_j and multiplying the weights' column j by s_j leaves x W^T
unchanged and, with s_j = max|x_j|^a / max|W_j|^(1-a), shares the range between the two
(Xiao et al., SmoothQuant, 2022). Int8Linear takes 1 / s as the kernel's x_scale.

The ranges max|x_j| come from one fp32 pass over 15 conversations of the training regeneration
(int8_calibration.json, ~3.7k tokens on SmolLM2, 7 s on 2 cores), each linear's inputs seen through a
forward hook, and are kept on disk per model file, so a model is measured once per machine.
docs/results.md (session 30) has the quality measured with and without.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from dspark.models.disk_cache import cached_tensors

ALPHA = 0.5

CALIBRATION = Path(__file__).with_name("int8_calibration.json")


def calibration_sequences(tokenizer) -> list[list[int]]:
    """The calibration conversations as token sequences, each through the tokenizer's chat template."""
    turns = json.loads(CALIBRATION.read_text())["turns"]
    return [tokenizer.encode_chat([{"role": "user", "content": t["user"]}, {"role": "assistant", "content": t["assistant"]}])
            for t in turns]


def smoothing_scale(input_max: torch.Tensor, weight: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """s [in]: x / s and W * s (by column) for a linear whose inputs reach input_max [in]."""
    weight_max = weight.detach().float().abs().amax(0).clamp_min(1e-5)
    return (input_max.float().clamp_min(1e-5) ** alpha / weight_max ** (1 - alpha)).clamp_min(1e-5)


def linear_input_ranges(model: nn.Module, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """{name: max |x| [in]} of every nn.Linear's inputs over the sequences, each read in one fp32 pass
    (prefill), the projections fused first (the linears that will run)."""
    from dspark.models.batch import VarlenBatch
    from dspark.models.precision import fuse_projections

    fuse_projections(model)
    names = {m: name for name, m in model.named_modules() if type(m) is nn.Linear}
    ranges: dict[str, torch.Tensor] = {}

    def record(linear, args):
        seen = args[0].detach().reshape(-1, linear.in_features).abs().amax(0).float()
        name = names[linear]
        ranges[name] = seen if name not in ranges else torch.maximum(ranges[name], seen)

    hooks = [m.register_forward_pre_hook(record) for m in names]
    try:
        with torch.no_grad():
            for tokens in sequences:
                cache = model.new_cache(1, len(tokens))
                model(VarlenBatch.build([tokens], [0], [cache.allocate()]), cache, logits_rows="all")
    finally:
        for hook in hooks:
            hook.remove()
    return ranges


def cached_input_ranges(model: nn.Module, sequences: list[list[int]], model_path: Path) -> dict[str, torch.Tensor]:
    """linear_input_ranges, kept on disk (disk_cache.py) under the model files' identity (path, sizes,
    mtimes) and the sequences: measured once."""
    files = sorted(f for f in model_path.iterdir() if f.is_file()) if model_path.is_dir() else [model_path]
    identity = [str(model_path.resolve())] + [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = hashlib.sha256(json.dumps([identity, sequences]).encode()).hexdigest()[:24]
    return cached_tensors(f"{model_path.stem}-int8-ranges-{key}", lambda: linear_input_ranges(model, sequences))
