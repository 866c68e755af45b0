"""Tensors worked out from a model file once per machine and kept on disk: $DSPARK_CACHE, default
~/.cache/dspark (the dequantized GGUF, int8's calibrated input ranges)."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def cached_tensors(name: str, compute: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensors kept as `name`.safetensors, else compute() and keep them (a whole file or none, also
    with services starting side by side; a read-only home only costs the next load its time)."""
    cache_dir = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))
    cached = cache_dir / f"{name}.safetensors"
    if cached.exists():
        try:
            return load_file(str(cached))
        except Exception:  # cut short or unreadable: compute again
            pass
    tensors = compute()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.tmp")
        save_file({key: t.contiguous() for key, t in tensors.items()}, str(partial))
        os.replace(partial, cached)
    except OSError:
        pass
    return tensors
