"""Which device the models run on (`--device cpu|cuda|cuda:N`), and how host values get there.

Every tensor of a step is created on the model's device; bytes cross host<->device only where
they go on or off the wire (features to the drafter, tokens out). Small host values (token ids,
positions, per-row sampling settings) are staged in pinned memory and copied without blocking,
so the copy overlaps the host work that follows instead of stalling the GPU's queue.
"""
from __future__ import annotations

import argparse
import os

import torch

DEVICE_NAMES = "cpu, cuda or cuda:N"


class DeviceUnavailable(RuntimeError):
    """--device names an accelerator this process cannot use."""


def add_device_flag(ap: argparse.ArgumentParser, default: str = "cpu") -> None:
    """--device, defaulting to $DSPARK_DEVICE, else `default`."""
    ap.add_argument("--device", default=os.environ.get("DSPARK_DEVICE") or default,
                    help=f"{DEVICE_NAMES} (default: $DSPARK_DEVICE, else {default})")


def resolve_device(name: str | torch.device) -> torch.device:
    """The torch.device for `name`; ValueError for a malformed name, DeviceUnavailable when it
    names a GPU this process has not got (checked here, before any weight is loaded)."""
    text = str(name).strip().lower()
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device must be {DEVICE_NAMES}, got {name!r}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"--device must be {DEVICE_NAMES}, got {name!r}")
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise DeviceUnavailable(f"--device {text}: {why} (torch {torch.__version__}, "
                                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                                "run with --device cpu or on a GPU node")
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise DeviceUnavailable(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return torch.device("cuda", index)


def device_or_exit(name: str | torch.device, who: str) -> torch.device:
    """resolve_device for a command line: a bad or missing device ends the process with the reason."""
    try:
        return resolve_device(name)
    except (ValueError, DeviceUnavailable) as error:
        raise SystemExit(f"{who}: {error}") from None


def describe(device: torch.device) -> str:
    """'cpu' or 'cuda:0 (NVIDIA H200)': for logs, health and metrics."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def model_device(module: torch.nn.Module) -> torch.device:
    """Where a module's weights live (cpu for a module without any)."""
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timings; a no-op on CPU, where calls finish in place)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_values(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of Python `values` on `device`: built in pinned memory and copied without
    blocking on CUDA, built in place on CPU."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)
