"""torch.Tensor <-> dspark.v1.Tensor: raw little-endian bytes with dtype and shape.

Every float array that crosses a process goes through here (method.md 6, wire rules).
Decoding checks the message against its declared dtype and shape before touching the bytes,
so a truncated or mislabelled tensor fails loudly instead of turning into garbage numbers.
"""

import math
import sys

import torch

from dspark.proto_gen.v1 import tensor_pb2

# torch tensors are in host byte order; the wire is little-endian. Every machine we target
# (x86-64, aarch64) is little-endian, so we refuse the rare other instead of byte-swapping.
if sys.byteorder != "little":
    raise ImportError("dspark.wire assumes a little-endian host")

DType = tensor_pb2.DType
TO_WIRE = {
    torch.float32: DType.DTYPE_F32,
    torch.float16: DType.DTYPE_F16,
    torch.bfloat16: DType.DTYPE_BF16,
    torch.int32: DType.DTYPE_I32,
    torch.int64: DType.DTYPE_I64,
    torch.uint8: DType.DTYPE_U8,
    torch.bool: DType.DTYPE_BOOL,
}
FROM_WIRE = {wire: dtype for dtype, wire in TO_WIRE.items()}

# Guards a receiver against a message that declares a huge shape (2**28 elements = 512 MiB
# in bf16, far above any hidden-state batch we send).
MAX_ELEMENTS = 1 << 28


class WireError(ValueError):
    """A Tensor message that does not match its declared or expected dtype and shape."""


def tensor_to_proto(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    if tensor.dtype not in TO_WIRE:
        raise WireError(f"cannot send dtype {tensor.dtype}; supported: {sorted(map(str, TO_WIRE))}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    # Viewing as bytes works for every dtype, bf16 included (numpy has no bf16).
    data = flat.view(torch.uint8).numpy().tobytes()
    return tensor_pb2.Tensor(dtype=TO_WIRE[tensor.dtype], shape=list(tensor.shape), data=data)


def tensor_from_proto(
    message: tensor_pb2.Tensor,
    expected_dtype: torch.dtype | None = None,
    expected_shape: tuple[int | None, ...] | None = None,
    max_elements: int = MAX_ELEMENTS,
) -> torch.Tensor:
    """Decode and validate. `expected_shape` may use None for a dimension of any size,
    e.g. (None, m * d) for a hidden-state batch of unknown length."""
    dtype = FROM_WIRE.get(message.dtype)
    if dtype is None:
        name = DType.Name(message.dtype) if message.dtype in DType.values() else str(message.dtype)
        raise WireError(f"unknown tensor dtype {name}")
    shape = tuple(message.shape)
    if any(dim < 0 for dim in shape):
        raise WireError(f"negative dimension in tensor shape {list(shape)}")
    if expected_dtype is not None and dtype != expected_dtype:
        raise WireError(f"tensor dtype is {dtype}, expected {expected_dtype}")
    if expected_shape is not None and not _shape_matches(shape, expected_shape):
        want = ", ".join("*" if dim is None else str(dim) for dim in expected_shape)
        raise WireError(f"tensor shape is {list(shape)}, expected [{want}]")
    numel = math.prod(shape)
    if numel > max_elements:
        raise WireError(f"tensor of shape {list(shape)} has {numel} elements, over the limit of {max_elements}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(message.data) != numel * itemsize:
        raise WireError(
            f"tensor data is {len(message.data)} bytes, but shape {list(shape)} of {dtype} "
            f"needs {numel} * {itemsize} = {numel * itemsize}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer rejects an empty buffer
    # bytearray: a writable copy the tensor owns (frombuffer on bytes would share read-only memory).
    raw = torch.frombuffer(bytearray(message.data), dtype=torch.uint8)
    if dtype == torch.bool and bool((raw > 1).any()):
        raise WireError("bool tensor holds bytes other than 0 and 1")
    return raw.view(dtype).reshape(shape)


def _shape_matches(shape: tuple[int, ...], expected: tuple[int | None, ...]) -> bool:
    return len(shape) == len(expected) and all(want is None or got == want for got, want in zip(shape, expected))
