"""A TorchFunctionMode that fails a step whose tensors do not all live on the model's device.

On a CPU-only torch a CUDA tensor cannot exist, so "the tensor landed on the wrong device" is
checked by its cause instead: a factory call (torch.tensor, arange, zeros, ...) that does not
name the model's device would put its tensor on the CPU once the model runs on a GPU. Rules:

- a factory call names `device=` equal to the model's device; the only host tensors allowed are
  pinned staging buffers (`pin_memory=True`, copied to the device right after) and draws from a
  CPU `generator=` (seeded replay uses CPU generators on every device, by design);
- every op's tensor inputs share one device (0-dim CPU scalars excepted, as torch allows them),
  so a host tensor can meet a device tensor only through an explicit copy (`.to`, `.cpu`, ...).

The same checker runs on a GPU (scripts/gpu_check.sh), where the second rule also catches what
torch would silently accept, such as indexing a CUDA tensor with a CPU index tensor.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

FACTORIES = {
    torch.tensor, torch.as_tensor, torch.arange, torch.range, torch.zeros, torch.ones, torch.empty, torch.full,
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace, torch.logspace, torch.eye,
    torch.empty_strided, torch.scalar_tensor,
}
# Explicit host<->device copies: their inputs and outputs may differ in device.
TRANSFERS = {
    torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.copy_, torch.Tensor.tolist,
    torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.pin_memory, torch.Tensor.__bool__,
    torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
}


class DeviceViolation(AssertionError):
    pass


def _normalized(device) -> torch.device:
    """cuda means the current GPU: compare it by index, as tensors report it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _name(func) -> str:
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    return qualname.replace("_VariableFunctionsClass.", "")


class DeviceChecker(TorchFunctionMode):
    def __init__(self, device: torch.device | str):
        super().__init__()
        self.device = _normalized(device)
        self.violations: list[str] = []
        self.factory_calls = 0  # how many creations it checked: a test can see it really looked

    def _fail(self, message: str):
        self.violations.append(message)
        raise DeviceViolation(message)

    def _check_factory(self, func, args, kwargs) -> None:
        if (func in (torch.tensor, torch.as_tensor) and args and isinstance(args[0], torch.Tensor)
                and kwargs.get("device") is None):
            return  # wraps an existing tensor: it stays where it is
        self.factory_calls += 1
        generator = kwargs.get("generator")
        if kwargs.get("pin_memory"):
            return  # host staging buffer for a non-blocking copy
        if (generator is not None and kwargs.get("device") in (None, generator.device, str(generator.device))
                and (generator.device.type == "cpu" or generator.device == self.device)):
            return  # a draw from a request's (CPU) generator
        device = kwargs.get("device")
        if device is None:
            self._fail(f"torch.{_name(func)} without device=: it lands on the CPU whatever device the model uses")
        if _normalized(device) != self.device:
            self._fail(f"torch.{_name(func)}(device={device}) in a step on {self.device}")

    def _check_inputs(self, func, args, kwargs) -> None:
        devices = {t.device for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and not (t.dim() == 0 and t.device.type == "cpu")}
        if len(devices) > 1:
            self._fail(f"{_name(func)} mixes tensors on {sorted(map(str, devices))}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            self._check_factory(func, args, kwargs)
        elif func not in TRANSFERS:
            self._check_inputs(func, args, kwargs)
        return func(*args, **kwargs)

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        # A violation swallowed by the code under test (a broad except) still fails the check.
        if exc[0] is None and self.violations:
            raise DeviceViolation("; ".join(self.violations))
        return result
