"""Serving precision: which matmul kernels the target and the drafters run on this CPU or GPU.

`fp32` keeps `nn.Linear` (parity with transformers). `gguf` keeps the weights a GGUF checkpoint
stores as Q4_1 / Q8_0 blocks in those blocks and multiplies in fp32 (dspark/kernels/gguf_matmul.cpp):
the same fp32 model, 5.6x fewer bytes a token; a target without blocks (an HF checkpoint) stays
fp32, a drafter (`exact_matmuls = False`) gets Q8_0 blocks of its weights made at load. `gguf-q8`
multiplies the same blocks by each row of activations rounded to 8-bit blocks of 32
(dspark/kernels/gguf_q8_matmul.cpp: integer dot products, llama.cpp's math, no fp32 dequantization:
1.7x gguf's decoding speed on an AVX2 EPYC, 98% top-1 agreement with fp32). `bf16`
stores weights in bf16 and runs them on oneDNN prepacked kernels (AMX where the CPU has it).
`int8` stores weights int8 per output channel with activations quantized per row, so a row's
result never depends on the other rows of its batch (loaded models first move their activation
outliers into the weights with SmoothQuant's scales, int8_smoothing.py): dspark/kernels/int8_matmul.cpp on AVX-512 VNNI
(the weights read once for up to 8 rows; calls of 8 rows and more on AMX tiles where the CPU has
them, the same integer sums), FBGEMM elsewhere. `auto` picks by what the CPU
has: int8 on AVX-512 VNNI / AVX-VNNI (AMX hosts included), else gguf-q8 on AVX2 (fp32 where a
module has no GGUF blocks), else fp32
(docs/results.md has the measurements behind the rule).
On CUDA `auto` is bf16 and bf16 is a plain bf16 `nn.Linear` (cuBLAS, tensor cores); int8 is a
CPU kernel (FBGEMM) and is refused there.

Every kernel here is batch-invariant: the same row gives bit-identical output whatever else is
in the batch, so a speculative verification pass decides exactly what plain decoding would.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dspark.models.int8_smoothing import smoothing_scale

PRECISIONS = ("auto", "fp32", "gguf", "gguf-q8", "bf16", "int8")
GGUF_PRECISIONS = ("gguf", "gguf-q8")  # the two that multiply by a GGUF's own blocks
log = logging.getLogger(__name__)


# Set DSPARK_CPU_ISA=avx2 to build the kernels and choose precisions as on a CPU without AVX-512,
# VNNI or AMX (an AVX2 EPYC): that path, tested on a host that has them.
AVX2_ONLY = os.environ.get("DSPARK_CPU_ISA", "") == "avx2"


@functools.cache
def cpu_flags() -> frozenset[str]:
    flags: frozenset[str] = frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = frozenset(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    if AVX2_ONLY:
        flags = frozenset(f for f in flags if not f.startswith(("avx512", "amx", "avx_vnni", "avx_ne")))
    return flags


def has_vnni() -> bool:
    """8-bit dot products accumulate in 32 bits (AVX-512 VNNI / AVX-VNNI). Without them x86 int8 kernels
    add pairs of u8 x s8 products in 16 bits, which saturates unless activations keep to 7 bits."""
    return bool({"avx512_vnni", "avx_vnni"} & cpu_flags())


def has_gguf_matmul() -> bool:
    """dspark/kernels/gguf_matmul.cpp runs here: AVX2, FMA and F16C, C++ kernels not turned off."""
    return {"avx2", "fma", "f16c"} <= cpu_flags() and os.environ.get("DSPARK_CPU_KERNELS", "1") != "0"


def has_bf16_matmul() -> bool:
    """oneDNN's prepacked bf16 linear runs here (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    flags = cpu_flags()
    return "avx_ne_convert" in flags or {"avx512bw", "avx512vl", "avx512dq"} <= flags


def add_precision_flag(ap: argparse.ArgumentParser, default: str = "auto") -> None:
    """--precision, defaulting to $DSPARK_PRECISION, else `default`."""
    ap.add_argument("--precision", default=os.environ.get("DSPARK_PRECISION", default), choices=PRECISIONS,
                    help="matmul kernels (auto: int8 on VNNI, else gguf-q8 on AVX2, else fp32; fp32 = "
                         "parity with transformers; gguf = fp32 math on a GGUF's own Q4_1/Q8_0 blocks; gguf-q8 = "
                         "those blocks times 8-bit activation blocks, integer dot products as llama.cpp)")


def resolve_precision(name: str, device: torch.device | str = "cpu") -> str:
    """A concrete precision for `name` on `device` (auto -> what it runs fastest)."""
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
    if torch.device(device).type == "cuda":
        if name == "int8" or name in GGUF_PRECISIONS:
            raise ValueError(f"precision {name} runs on CPU kernels only; on cuda use bf16, fp32 or auto")
        return "bf16" if name == "auto" else name
    if name == "bf16" and not has_bf16_matmul():
        raise ValueError("precision bf16 needs a CPU with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT for oneDNN's "
                         "bf16 kernels, and this one has neither: use fp32, int8 or auto")
    if name in GGUF_PRECISIONS and not has_gguf_matmul():
        raise ValueError(f"precision {name} needs a CPU with AVX2, FMA and F16C and the C++ kernels "
                         "(DSPARK_CPU_KERNELS not 0): use fp32 or auto")
    if name != "auto":
        return name
    # AMX hosts too: int8's own kernel reads half bf16's bytes and decodes ~3x faster there (docs/results.md).
    if has_vnni() and "fbgemm" in torch.backends.quantized.supported_engines:
        return "int8"
    return "gguf-q8" if has_gguf_matmul() else "fp32"


@dataclass(frozen=True)
class GgufBlocks:
    """A linear's weight as its GGUF file stores it: `data` [out, row bytes] uint8, ggml type `qtype`.
    The loader sets it on an nn.Linear as `gguf_blocks`; the precision gguf multiplies by it."""
    qtype: int
    data: torch.Tensor

    SUPPORTED = {3: 20, 8: 34}  # ggml Q4_1, Q8_0: bytes per block of 32 weights

    @classmethod
    def concat(cls, parts: list[GgufBlocks | None]) -> GgufBlocks | None:
        """Rows of several linears stacked (a fused q|k|v), when all have blocks of one type."""
        if any(p is None for p in parts) or len({p.qtype for p in parts}) != 1:
            return None
        return cls(parts[0].qtype, torch.cat([p.data for p in parts]))

    @classmethod
    def quantize(cls, weight: torch.Tensor, qtype: int = 8) -> GgufBlocks:
        """Blocks made from a float weight [out, in] by gguf's own quantizer (Q8_0 by default): an
        approximation, for modules whose matmuls need not be exact (a drafter's)."""
        import gguf

        blocks = gguf.quants.quantize(weight.detach().float().cpu().numpy(), gguf.GGMLQuantizationType(qtype))
        return cls(qtype, torch.from_numpy(np.ascontiguousarray(blocks)).reshape(weight.shape[0], -1))


def approximate_in_blocks(linear: nn.Linear) -> None:
    """Give a linear without GGUF blocks Q8_0 blocks of its weight (blocks hold 32 inputs: a
    narrower one stays fp32), for modules whose matmuls need not be exact (a drafter's)."""
    if getattr(linear, "gguf_blocks", None) is None and linear.in_features % 32 == 0:
        linear.gguf_blocks = GgufBlocks.quantize(linear.weight)


class GgufLinear(nn.Module):
    """y = x W^T + b, W in the GGUF's own blocks, batch-invariant: fp32 math on the dequantized
    weights (gguf_matmul.cpp), or with `q8_activations` x as 8-bit blocks and integer dot products
    (gguf_q8_matmul.cpp, llama.cpp's math)."""

    def __init__(self, linear: nn.Linear, q8_activations: bool = False):
        super().__init__()
        from dspark.kernels.cpu import kernels

        self.blocks: GgufBlocks = linear.gguf_blocks
        self.kernel = kernels().gguf_linear_q8 if q8_activations else kernels().gguf_linear
        if q8_activations and linear.out_features % 8 == 0:  # eight columns a vector (gguf_q8_matmul.cpp), 2-3x faster
            qtype = self.blocks.qtype  # the same bytes reordered, kept as the only copy
            self.blocks = GgufBlocks(qtype, kernels().gguf_interleave(self.blocks.data, qtype))
            self.kernel = kernels().gguf_linear_q8_interleaved
        self.bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x.reshape(-1, self.in_features), self.blocks.data, self.blocks.qtype)
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """y = x W^T + b with W int8 per output channel and x quantized per row (symmetric, 8 bits).

    On AVX-512 VNNI the matmul is dspark/kernels/int8_matmul.cpp: the weights stream from memory
    once for up to 8 rows at a time (a pass of 8 rows ~1.5x a decode step on a Zen 4, FBGEMM's 1.7x).
    Elsewhere it is FBGEMM's dynamic linear, which picks one activation range for the whole batch:
    each row is first scaled to max |x| = 1 and a guard row holding +1 and -1 is appended, so that
    range is always [-1, 1] and every row is quantized on its own scale, exactly as if it were
    alone. Without VNNI FBGEMM keeps activations to 7 bits (reduce_range), which would otherwise
    saturate.
    """

    def __init__(self, linear: nn.Linear, input_max: torch.Tensor | None = None):
        """input_max: max |x| [in] of the inputs seen in calibration (int8_smoothing.py): the inputs are
        then quantized as x / s and the weights as W * s, SmoothQuant's s. None: no smoothing."""
        super().__init__()
        w = linear.weight.detach().float()
        self.x_scale = None  # 1 / s, multiplied into each input before it is quantized
        if input_max is not None:
            smooth = smoothing_scale(input_max, w)
            w, self.x_scale = w * smooth, (1 / smooth).contiguous()
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
        self.bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = _int8_kernel()
        if self.kernel is not None:
            self.weight_blocks, self.w_scale = _pack_for_vnni(w, scale), scale.contiguous()
            return
        with warnings.catch_warnings():  # FBGEMM's prepack takes only the (deprecated) qint8 tensor type
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(w, scale.double(), torch.zeros(w.shape[0], dtype=torch.long), 0,
                                                 torch.qint8)
        with _quant_engine("fbgemm"):
            self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.guard = torch.zeros(1, self.in_features)
        self.guard[0, 0], self.guard[0, -1] = 1.0, -1.0
        self.reduce_range = not has_vnni()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self.kernel is not None:
            y = self.kernel(flat, self.weight_blocks, self.w_scale, self.bias, self.x_scale)
        else:
            if self.x_scale is not None:
                flat = flat * self.x_scale
            # Few ops on purpose: at one row each costs as much as the matmul's own overhead. max |x| as
            # abs().amax(): the same value as vector_norm(x, inf), which took 17-23x as long here (AVX-512
            # EPYC: 99 vs 5.7 us at 56 x 576, 254 vs 11 us at 56 x 1536).
            row_max = flat.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-12)
            y = torch.ops.quantized.linear_dynamic(torch.cat([flat / row_max, self.guard]), self.packed,
                                                    self.reduce_range)[:-1]
            y = y.mul_(row_max) if self.bias is None else torch.addcmul(self.bias, y, row_max)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """self(x).argmax(-1) for rows x [N, in], the same indices; on the VNNI kernel without writing
        the outputs (an LM head's argmax at a greedy step: 49,152 floats a row)."""
        if self.kernel is None:
            return self(x).argmax(dim=-1)
        x = x.float()
        tokens = _int8_argmax_kernel()(x, self.weight_blocks, self.w_scale, self.bias, self.x_scale)
        nan = tokens < 0  # a row with a NaN output: torch's argmax of its outputs decides
        if bool(nan.any()):
            tokens[nan] = self(x[nan]).argmax(dim=-1)
        return tokens


def _int8_argmax_kernel():
    from dspark.kernels.cpu import kernels

    return kernels().int8_linear_argmax


def _int8_kernel():
    """int8_matmul.cpp's int8_linear where it runs (AVX-512 VNNI, C++ kernels on), else None: FBGEMM.
    `DSPARK_INT8_KERNEL=fbgemm` keeps FBGEMM anywhere (benchmarks/engine_speed.py's int8-fbgemm);
    `DSPARK_INT8_AMX=0` keeps calls of many rows off the AMX tiles too (the same bits, for comparisons)."""
    if os.environ.get("DSPARK_INT8_KERNEL", "vnni") == "fbgemm":
        return None
    from dspark.kernels.cpu import kernels

    module = kernels()
    if module is None or not module.has_int8_linear():
        return None
    module.int8_use_amx(os.environ.get("DSPARK_INT8_AMX", "1") != "0")
    return module.int8_linear


def _pack_for_vnni(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W [out, in] as int8_matmul.cpp reads it: unsigned bytes round(W / scale) + 128 in blocks of 16
    outputs x 4 inputs, [ceil(out / 16)][ceil(in / 4)][16][4], padded with zero weights (byte 128)."""
    out_features, in_features = w.shape
    q = torch.full((-(-out_features // 16) * 16, -(-in_features // 4) * 4), 128, dtype=torch.int16)
    q[:out_features, :in_features] += torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int16)
    return q.to(torch.uint8).view(q.shape[0] // 16, 16, q.shape[1] // 4, 4).permute(0, 2, 1, 3).contiguous()


class Bf16Linear(nn.Module):
    """bf16 weights prepacked for oneDNN (AMX where the CPU has it); fp32 in and out.

    A plain bf16 matmul takes a different path for one row than for several, so its rows change
    with the batch. oneDNN's prepacked kernel gives a row the same bits at any row count from 2
    to 32 (measured for every SmolLM2 shape on AVX-512 and AMX CPUs); one row may take a gemv
    path, and on AMX some shapes (576 x 576, the LM head) change kernel above 32 rows. So a lone
    row is padded to two and a larger batch runs in calls of at most 32 rows, none of one row.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().to(torch.bfloat16).contiguous()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w, None)
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).clone()
        self.in_features, self.out_features = linear.in_features, linear.out_features

    MAX_ROWS = 32
    native_dtype = torch.bfloat16  # what native() takes and returns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.native(x.reshape(-1, self.in_features).to(torch.bfloat16))
        return y.float().reshape(*shape[:-1], self.out_features)

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """[N, in] bf16 -> [N, out] bf16, no casts (the fused decoder layer feeds it bf16 directly)."""
        rows = x.shape[0]
        if rows % self.MAX_ROWS == 1:  # no call of one row
            x = torch.cat([x, x[-1:]])
        if x.shape[0] <= self.MAX_ROWS:
            return self._matmul(x)[:rows]
        return torch.cat([self._matmul(chunk) for chunk in x.split(self.MAX_ROWS)])[:rows]

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


@contextlib.contextmanager
def whole_calls():
    """bf16 linears take any number of rows in one call while inside. For work where a row has no
    other rows to stay invariant to (one sequence's teacher-forced features for training: the same
    sequence always makes the same calls), where 32-row calls cost ~1.7x on a long prefill."""
    old, Bf16Linear.MAX_ROWS = Bf16Linear.MAX_ROWS, 1 << 30
    try:
        yield
    finally:
        Bf16Linear.MAX_ROWS = old


class CudaBf16Linear(nn.Module):
    """bf16 weights on the GPU, fp32 in and out: one cuBLAS bf16 matmul (tensor cores), half the
    weight bytes a decode step reads. The residual stream and the KV cache stay in the model's dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(torch.bfloat16),
                                                                  requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)


@contextlib.contextmanager
def _quant_engine(name: str):
    old, torch.backends.quantized.engine = torch.backends.quantized.engine, name
    try:
        yield
    finally:
        torch.backends.quantized.engine = old


def convert_linear(linear: nn.Linear, precision: str, input_max: torch.Tensor | None = None) -> nn.Module:
    """input_max: the linear's calibrated input ranges (int8 only: SmoothQuant scales)."""
    if precision == "fp32":
        return linear
    if linear.weight.is_cuda:
        if precision == "bf16":
            return CudaBf16Linear(linear)
        raise ValueError(f"no CUDA kernel for precision {precision!r}")
    if precision in GGUF_PRECISIONS:  # the fp32 module where there are no blocks (an HF checkpoint, a drafter)
        has_blocks = getattr(linear, "gguf_blocks", None) is not None
        return GgufLinear(linear, q8_activations=precision == "gguf-q8") if has_blocks else linear
    if precision == "int8":
        return Int8Linear(linear, input_max)
    if precision == "bf16":
        return Bf16Linear(linear)
    raise ValueError(f"no kernel for precision {precision!r}")


def fuse_projections(module: nn.Module) -> None:
    """Fuse what the module's parts offer to fuse (`fuse_projections`: q|k|v, gate|up), in place."""
    for sub in list(module.modules()):
        if hasattr(sub, "fuse_projections"):
            sub.fuse_projections()


def module_precision(module: nn.Module, precision: str) -> str:
    """The concrete precision `precision` means for this module's device."""
    weights = next(module.parameters(), None)
    return resolve_precision(precision, weights.device if weights is not None else "cpu")


def apply_precision(module: nn.Module, precision: str, input_ranges: dict | None = None) -> str:
    """Fuse what a module offers to fuse, then put every nn.Linear on the precision's kernels, in
    place. Returns the concrete precision (for the module's device). input_ranges: {linear's name in
    the module: max |x| [in]} from calibration (int8_smoothing.py), for int8's SmoothQuant scales.
    Inference only: no gradients."""
    precision = module_precision(module, precision)
    fuse_projections(module)
    if precision == "fp32":
        return precision
    if precision in GGUF_PRECISIONS and not getattr(module, "exact_matmuls", True):
        # A drafter's matmuls decide only what is proposed, never what is accepted: Q8_0 blocks of
        # its weights, made now, put it on the same kernel at a quarter of fp32's bytes.
        for linear in module.modules():
            if type(linear) is nn.Linear:
                approximate_in_blocks(linear)
    if precision in GGUF_PRECISIONS and not any(getattr(m, "gguf_blocks", None) is not None for m in module.modules()):
        return "fp32"  # nothing stored in blocks: every matmul stays fp32, say so
    for parent_name, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                ranges = (input_ranges or {}).get(f"{parent_name}.{name}" if parent_name else name)
                setattr(parent, name, convert_linear(child, precision, ranges))
        if hasattr(parent, "use_precision"):  # matmuls on weights that are not an nn.Linear
            parent.use_precision(precision)
    log.info("matmuls on %s kernels", precision)
    return precision
