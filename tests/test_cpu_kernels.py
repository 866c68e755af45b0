"""dspark/kernels: each CPU kernel against torch's own ops, alone; the fused decoder layer against
the module path; and the errors a bad call gets."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from dspark.kernels.cpu import kernels
from dspark.models.batch import VarlenBatch
from dspark.models.int8_smoothing import linear_input_ranges
from dspark.models.layers import Rotary, apply_rope, rope_tables
from dspark.models.precision import Int8Linear, _pack_for_vnni, has_gguf_matmul
from tests.spec_helpers import tiny_target, with_gguf_blocks

ops = kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ compiler: the CPU kernels could not be built")


@contextlib.contextmanager
def torch_threads(n: int):
    """torch on n threads inside the block, the process's count again after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference_attention(q, kc, vc, slots, positions):
    """Each row over its slot's keys 0..position, in float64 through SDPA."""
    rows = []
    group = q.shape[1] // kc.shape[1]
    for r in range(q.shape[0]):
        keys = int(positions[r]) + 1
        k = kc[slots[r], :, :keys].double().repeat_interleave(group, 0)
        v = vc[slots[r], :, :keys].double().repeat_interleave(group, 0)
        rows.append(F.scaled_dot_product_attention(q[r][:, None].double(), k, v).reshape(-1))
    return torch.stack(rows).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (16, 4, 1), (24, 6, 2)])
def test_cached_attention_matches_sdpa_and_ignores_the_rest_of_the_batch(dtype, head_dim, heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(3, kv_heads, 200, head_dim, generator=g).to(dtype)
    vc = torch.randn(3, kv_heads, 200, head_dim, generator=g).to(dtype)
    # A verified block of 9 rows of slot 2 (its rows share the reads of each key, in groups), lone
    # rows, and a run of slot 1; key counts on both sides of 16-key boundaries.
    slots = torch.tensor([2] * 9 + [0, 1, 1, 0])
    positions = torch.tensor([143 + i for i in range(9)] + [0, 15, 16, 63])
    q = torch.randn(len(slots), heads, head_dim, generator=g)
    out = ops.cached_attention(q, kc, vc, slots, positions)
    torch.testing.assert_close(out, reference_attention(q, kc, vc, slots, positions), rtol=1e-5, atol=2e-6)
    alone = torch.cat([ops.cached_attention(q[r:r + 1], kc, vc, slots[r:r + 1], positions[r:r + 1])
                       for r in range(len(slots))])
    assert torch.equal(out, alone)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("rows", [2, 3, 4, 8])
def test_one_requests_block_gets_each_rows_lone_bits_at_any_thread_count(rows, threads):
    """A batch of one request's rows alone is cut into tasks by the thread count (balanced_pieces):
    whatever the cut, every row gets the bits it gets alone on one thread."""
    g = torch.Generator().manual_seed(1)
    kc, vc = (torch.randn(1, 3, 300, 64, generator=g) for _ in range(2))
    slots, positions = torch.zeros(rows, dtype=torch.int64), torch.arange(250, 250 + rows)
    q = torch.randn(rows, 9, 64, generator=g)
    with torch_threads(threads):
        out = ops.cached_attention(q, kc, vc, slots, positions)
    with torch_threads(1):
        alone = torch.cat([ops.cached_attention(q[r:r + 1], kc, vc, slots[r:r + 1], positions[r:r + 1])
                           for r in range(rows)])
    assert torch.equal(out, alone)


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (16, 4, 1)])
def test_a_bf16_cache_gives_the_bits_of_an_fp32_cache_holding_the_same_values(head_dim, heads, kv_heads):
    """bf16 keys and values are widened to fp32 exactly (once per 16 keys for every head that reads
    them), so the cache's dtype changes only what it can hold, never the arithmetic after it."""
    g = torch.Generator().manual_seed(2)
    kc = torch.randn(2, kv_heads, 120, head_dim, generator=g).bfloat16()
    vc = torch.randn(2, kv_heads, 120, head_dim, generator=g).bfloat16()
    slots = torch.tensor([1] * 12 + [0])
    positions = torch.tensor([90 + i for i in range(12)] + [33])
    q = torch.randn(len(slots), heads, head_dim, generator=g)
    assert torch.equal(ops.cached_attention(q, kc, vc, slots, positions),
                       ops.cached_attention(q, kc.float(), vc.float(), slots, positions))


def test_rope_cache_attention_is_rope_then_cache_write_then_attention():
    heads, kv_heads, hd = 9, 3, 64
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * hd, generator=g)
    positions, slots = torch.tensor([40, 41, 42, 7, 8]), torch.tensor([0, 0, 0, 1, 1])
    cos, signed_sin = rope_tables(*Rotary(hd, 10000.0, None, 512).cos_sin(positions))
    kc, vc = torch.zeros(2, kv_heads, 64, hd), torch.zeros(2, kv_heads, 64, hd)
    kc[:, :, :40] = torch.randn(2, kv_heads, 40, hd, generator=g)
    vc[:, :, :40] = torch.randn(2, kv_heads, 40, hd, generator=g)
    expected_k, expected_v = kc.clone(), vc.clone()
    out = ops.rope_cache_attention(qkv.clone(), cos.view(5, hd), signed_sin.view(5, hd), kc, vc, slots, positions,
                                   heads, False)
    qk = apply_rope(qkv[:, :(heads + kv_heads) * hd].view(5, heads + kv_heads, hd), cos, signed_sin)
    expected_k[slots, :, positions] = qk[:, heads:]
    expected_v[slots, :, positions] = qkv[:, (heads + kv_heads) * hd:].view(5, kv_heads, hd)
    torch.testing.assert_close(kc, expected_k, rtol=0, atol=1e-6)
    assert torch.equal(vc, expected_v)
    q = qk[:, :heads].contiguous()
    torch.testing.assert_close(out, reference_attention(q, expected_k, expected_v, slots, positions),
                               rtol=1e-5, atol=2e-6)
    as_bf16 = ops.rope_cache_attention(qkv.bfloat16(), cos.view(5, hd), signed_sin.view(5, hd), kc, vc, slots,
                                       positions, heads, True)
    assert as_bf16.dtype == torch.bfloat16 and as_bf16.shape == out.shape


def test_norms_and_swiglu_match_torch():
    g = torch.Generator().manual_seed(2)
    x, w, delta = torch.randn(6, 576, generator=g), torch.rand(576, generator=g) + 0.5, torch.randn(6, 576, generator=g)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-6)
    residual = x.clone()
    normed = ops.add_rms_norm(residual, delta.bfloat16(), w, 1e-5, True)
    assert torch.equal(residual, x + delta.bfloat16().float())  # the add happens in place, exactly
    assert torch.equal(normed, ops.rms_norm(residual, w, 1e-5).bfloat16())
    gate_up = torch.randn(6, 2 * 96, generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up, False), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_norm_and_swiglu_rows_of_a_large_call_get_the_bits_they_get_alone(threads):
    """Calls of many rows (a prefill, a full batch) are shared out between the threads; each row
    still gets exactly the bits of a call of its own, on any thread count."""
    g = torch.Generator().manual_seed(3)
    x, delta, w = torch.randn(300, 576, generator=g), torch.randn(300, 576, generator=g), torch.rand(576, generator=g)
    gate_up = torch.randn(300, 2 * 1536, generator=g) * 4
    residual = x.clone()
    with torch_threads(threads):
        normed, swiglu = ops.add_rms_norm(residual, delta, w, 1e-5, False), ops.silu_mul(gate_up, False)
    with torch_threads(1):
        for r in (0, 17, 150, 299):
            alone = x[r:r + 1].clone()
            assert torch.equal(ops.add_rms_norm(alone, delta[r:r + 1], w, 1e-5, False), normed[r:r + 1])
            assert torch.equal(alone, residual[r:r + 1])
            assert torch.equal(ops.silu_mul(gate_up[r:r + 1], False), swiglu[r:r + 1])


def test_fused_layers_compute_what_the_layer_modules_do(monkeypatch):
    """The fused cached pass (residual adds deferred, features captured as copies) against the
    module-by-module path with the kernels off: same logits, hidden states and features."""
    target = tiny_target(layers=3)
    target.set_precision("fp32")  # fuses q|k|v and gate|up: the fused path applies
    prompt, more = [5, 9, 11, 3, 7, 2, 30], [8, 1]

    def run():
        cache = target.new_cache(1, 32)
        slot = cache.allocate()
        first = target(VarlenBatch.build([prompt], [0], [slot]), cache, capture_layers=(0, 2), logits_rows="all")
        second = target(VarlenBatch.build([more], [len(prompt)], [slot]), cache, capture_layers=(1,), logits_rows="all")
        return first.logits, first.features, first.hidden, second.logits, second.features

    fused = run()
    monkeypatch.setenv("DSPARK_CPU_KERNELS", "0")
    modules = run()
    for a, b in zip(fused, modules):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def random_gguf_blocks(out_features: int, in_features: int, qtype: int, seed: int = 0) -> torch.Tensor:
    """[out, row bytes] uint8 rows of GGUF blocks: Q4_1 (fp16 d, fp16 m, 16 nibble bytes) or
    Q8_0 (fp16 d, 32 int8), random quants, small finite scales."""
    g = torch.Generator().manual_seed(seed)
    blocks = out_features * in_features // 32
    scales = (torch.rand(blocks, 2, generator=g) * 0.02 - 0.01).half().view(torch.uint8).reshape(blocks, 4)
    if qtype == 3:
        quants = torch.randint(0, 256, (blocks, 16), generator=g, dtype=torch.uint8)
        return torch.cat([scales, quants], 1).reshape(out_features, -1)
    quants = torch.randint(0, 256, (blocks, 32), generator=g, dtype=torch.uint8)
    return torch.cat([scales[:, :2], quants], 1).reshape(out_features, -1)


@pytest.mark.skipif(not has_gguf_matmul(), reason="no AVX2/FMA/F16C here: gguf is refused (test_precision)")
@pytest.mark.parametrize("qtype", [3, 8])
def test_gguf_linear_is_the_dequantized_matmul_and_each_row_the_same_at_any_row_count(qtype):
    """x W^T against fp64 on the dequantized weights; and row i's bits are the same alone as in
    any batch: row counts 1..9 cover every grouping of rows the kernel makes (4 or 2, then 1)."""
    blocks = random_gguf_blocks(37, 96, qtype)  # 37 outputs: full tiles of 4 and a partial one
    weight = ops.gguf_dequantize(blocks, qtype, 96)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(1))
    y = ops.gguf_linear(x, blocks, qtype)
    torch.testing.assert_close(y, (x.double() @ weight.double().T).float(), rtol=1e-5, atol=1e-5)
    for rows in range(1, 10):
        for start in range(0, 10 - rows):
            assert torch.equal(ops.gguf_linear(x[start:start + rows], blocks, qtype), y[start:start + rows])


def q8_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """gguf_linear_q8's math in fp64: x rounded to int8 blocks of 32 (scale max |x| / 127), each
    block's dot product with the weight quants exact, then scaled and summed."""
    rows, k = x.shape
    xb = x.float().reshape(rows, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)  # the rounding in fp32, as the kernel does it
    q_x = torch.round(xb * torch.where(amax > 0, 127 / amax, 0)).double()
    d_x = (amax / 127).double()
    raw = blocks.reshape(blocks.shape[0], k // 32, -1)
    d_w = raw[..., :2].contiguous().view(torch.float16).double()  # [out, blocks, 1]
    if qtype == 3:
        m_w = raw[..., 2:4].contiguous().view(torch.float16).double()
        nibbles = raw[..., 4:].long()
        q_w = torch.cat([nibbles & 15, nibbles >> 4], -1).double()
    else:
        m_w = torch.zeros_like(d_w)
        q_w = raw[..., 2:].contiguous().view(torch.int8).double()
    exact = torch.einsum("rbk,obk->rob", q_x, q_w)  # integers
    x_sums = (d_x * q_x.sum(-1, keepdim=True))[:, None, :, 0]  # Q4_1's min term multiplies these
    return (exact * d_w[None, :, :, 0] * d_x[:, None, :, 0] + m_w[None, :, :, 0] * x_sums).sum(-1)


needs_gguf_q8 = pytest.mark.skipif(not has_gguf_matmul(),
                                   reason="this CPU lacks AVX2/FMA/F16C, so it has no gguf-q8 kernel to test "
                                          "(test_precision checks that the precision is refused here)")


@needs_gguf_q8
@pytest.mark.parametrize("qtype", [3, 8])
def test_gguf_linear_q8_is_llama_cpp_math_and_each_row_the_same_at_any_row_count(qtype):
    """x as int8 blocks times the GGUF quants, against the same math in fp64; close to the fp32
    matmul (8-bit activations: ~1%); and row i's bits alone equal its bits in any batch: row
    counts 1..9 cover every grouping the kernel makes (4, then 2, then 1)."""
    blocks = random_gguf_blocks(37, 96, qtype)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(1))
    x[4] = 0.0  # an all-zero block quantizes to zeros, not NaN
    y = ops.gguf_linear_q8(x, blocks, qtype)
    torch.testing.assert_close(y.double(), q8_reference(x, blocks, qtype), rtol=1e-5, atol=1e-5)
    exact = x.double() @ ops.gguf_dequantize(blocks, qtype, 96).double().T
    assert ((y.double() - exact).norm() / exact.norm()) < 0.02
    for rows in range(1, 10):
        for start in range(0, 10 - rows):
            assert torch.equal(ops.gguf_linear_q8(x[start:start + rows], blocks, qtype), y[start:start + rows])


@needs_gguf_q8
@pytest.mark.parametrize("qtype", [3, 8])
@pytest.mark.parametrize("out,k", [(40, 96), (16, 576)])
def test_interleaved_blocks_are_the_same_math_and_each_row_the_same_at_any_row_count(out, k, qtype):
    """Blocks with eight columns interleaved (what gguf-q8 runs): the same integer block sums and
    scaling as gguf_linear_q8, in another fp32 order; row i's bits alone equal its bits in any batch
    (row counts 1..9: groupings of 4, 2 and 1)."""
    blocks = random_gguf_blocks(out, k, qtype)
    packed = ops.gguf_interleave(blocks, qtype)
    assert packed.numel() == blocks.numel()  # the same bytes, reordered
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2))
    x[4] = 0.0
    y = ops.gguf_linear_q8_interleaved(x, packed, qtype)
    torch.testing.assert_close(y.double(), q8_reference(x, blocks, qtype), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, ops.gguf_linear_q8(x, blocks, qtype), rtol=1e-5, atol=1e-5)
    for rows in range(1, 10):
        for start in range(0, 10 - rows):
            assert torch.equal(ops.gguf_linear_q8_interleaved(x[start:start + rows], packed, qtype), y[start:start + rows])


needs_vnni_int8 = pytest.mark.skipif(ops is None or not ops.has_int8_linear(),
                                     reason="no AVX-512 VNNI here: int8 runs on FBGEMM (test_precision covers it)")


@pytest.mark.parametrize("precision, smoothed", [
    pytest.param("int8", False, marks=needs_vnni_int8), pytest.param("int8", True, marks=needs_vnni_int8),
    pytest.param("gguf-q8", False, marks=needs_gguf_q8)])
def test_the_layer_stack_gives_the_python_loops_bits(precision, smoothed):
    """Transformer.forward through kernels().LayerStack (a pass's layers in one call) against its loop
    over fused_forward: the same kernels in the same order, so the same logits, hidden states and
    captured features, for a prompt prefilled beside another request's rows and then decode rows;
    int8 with SmoothQuant's input scales too, gguf-q8 on Q4_1 blocks."""
    target = tiny_target(layers=3)
    if precision == "gguf-q8":
        with_gguf_blocks(target)
    ranges = linear_input_ranges(target, [[5, 9, 11, 3, 7, 2, 30, 4]]) if smoothed else None
    assert target.set_precision(precision, ranges) == precision
    assert target._layer_stack is not None and len(target._layer_stack) == 3
    if precision == "int8":
        assert (target.model.layers[0].mlp.down_proj.x_scale is not None) == smoothed

    def run():
        cache = target.new_cache(2, 32)
        a, b = cache.allocate(), cache.allocate()
        first = target(VarlenBatch.build([[5, 9, 11, 3, 7, 2, 30], [4, 4]], [0, 0], [a, b]), cache,
                       capture_layers=(0, 2), logits_rows="all")
        second = target(VarlenBatch.build([[8, 1], [6]], [7, 2], [a, b]), cache, capture_layers=(2, 1),
                        logits_rows="all")
        return first.logits, first.features, first.hidden, second.logits, second.features, second.hidden

    stacked = run()
    stack, target._layer_stack = target._layer_stack, None  # the Python loop
    looped = run()
    target._layer_stack = stack
    for x, y in zip(stacked, looped):
        assert torch.equal(x, y)


def int8_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """int8_linear's math in fp64: each row rounded to int8 on max |x| / 127 (in fp32, as the kernel
    rounds), the weights to int8 on their channel's scale, the integer dot products exact."""
    amax = x.abs().amax(-1, keepdim=True)
    q_x = torch.round(x * torch.where(amax > 0, 127 / amax, 0)).double()
    q_w = torch.round(w / scale[:, None]).clamp(-127, 127).double()
    y = (q_x @ q_w.T) * (amax / 127).double() * scale.double()
    return y if bias is None else y + bias.double()


def int8_case(shape: tuple[int, int], bias: bool, rows: int, seed: int):
    """(w, its channel scales, bias or None, x [rows, in]) for an int8 kernel test: x has an outlier
    row (quantized on its own scale) at rows // 6 and an all-zero row (the bias, not NaN) at rows // 3."""
    out_features, in_features = shape
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g)
    scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, in_features, generator=g)
    x[rows // 6] *= 50
    x[rows // 3] = 0.0
    return w, scale, b, x


@needs_vnni_int8
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(37, 98), (64, 96), (16, 4), (5, 3)])  # ragged outputs and inputs
def test_int8_linear_is_exact_integer_math_and_each_row_the_same_at_any_row_count(shape, bias):
    """The kernel against its math in fp64 (to fp32 rounding), close to the fp32 matmul; a row's bits
    are the same alone and in any batch: 1..19 rows cover every grouping (8-row passes, then 7..1),
    on one thread and on two."""
    w, scale, b, x = int8_case(shape, bias, 19, seed=2)
    packed = _pack_for_vnni(w, scale)
    y = ops.int8_linear(x, packed, scale, b)
    torch.testing.assert_close(y.double(), int8_reference(x, w, scale, b), rtol=1e-5, atol=1e-4)
    exact = x @ w.T + (0 if b is None else b)
    assert ((y - exact).norm() / exact.norm()) < 0.02
    for n in (1, 2):
        with torch_threads(n):
            for rows in range(1, 20):
                for start in (0, 19 - rows):
                    assert torch.equal(ops.int8_linear(x[start:start + rows], packed, scale, b), y[start:start + rows])


@needs_vnni_int8
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_rows_quantized_on_several_threads_get_the_bits_they_get_alone(threads):
    """A call of more rows than one thread quantizes (a prefill) splits its rows' quantization
    between the threads: each row's outputs are still those of a call of its own."""
    w, scale, b, x = int8_case((96, 576), True, 300, seed=4)
    packed = _pack_for_vnni(w, scale)
    with torch_threads(threads):
        y = ops.int8_linear(x, packed, scale, b)
    with torch_threads(1):
        for r in (0, 130, 299):
            assert torch.equal(ops.int8_linear(x[r:r + 1], packed, scale, b), y[r:r + 1])


@pytest.mark.skipif(ops is None or not ops.has_int8_amx(), reason="no AMX-INT8 here: every int8 call runs on VNNI")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(37, 64), (96, 576), (48, 1536)])  # inputs in whole tiles of 64; ragged outputs
def test_int8_linear_on_amx_tiles_gives_the_vnni_bits(shape, bias):
    """Calls of 8 rows and more take the tile unit: its integer sums are exact as VNNI's and the
    epilogue is shared, so every row gets the bits of the VNNI path and of itself alone, at every row
    count across the switch (7/8 rows, a padded tile, a second tile at 17 and 33, a ragged last tile),
    on one thread and on two; the argmax of the LM head follows."""
    w, scale, b, x = int8_case(shape, bias, 70, seed=4)
    packed = _pack_for_vnni(w, scale)
    alone = torch.cat([ops.int8_linear(x[i:i + 1], packed, scale, b) for i in range(len(x))])  # 1 row: VNNI
    torch.testing.assert_close(alone.double(), int8_reference(x, w, scale, b), rtol=1e-5, atol=1e-4)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in (7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 70):
                for amx in (True, False):
                    ops.int8_use_amx(amx)
                    assert torch.equal(ops.int8_linear(x[:rows], packed, scale, b), alone[:rows]), (rows, amx)
                    assert torch.equal(ops.int8_linear_argmax(x[:rows], packed, scale, b), alone[:rows].argmax(-1))
    finally:
        ops.int8_use_amx(True)
        torch.set_num_threads(threads)


@needs_vnni_int8
# a ragged last block; one tile; ties 213 and 320 in one scanned run of tiles, in its two lane sets; many tiles
@pytest.mark.parametrize("out_features", [37, 49, 640, 4099])
def test_int8_linear_argmax_is_torch_argmax_of_its_outputs(out_features):
    """The greedy LM head: the index torch.argmax takes from int8_linear's outputs, for random rows and
    rows whose largest output repeats (the first wins), on one thread and on two; NaN rows come back as
    -1 from the kernel, and Int8Linear.argmax resolves them as torch does; all -inf gives index 0."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(out_features, 64, generator=g)
    for i in (out_features // 3, out_features // 2):  # copies of the last row: their outputs tie with it
        w[i] = w[-1]
    scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
    packed = _pack_for_vnni(w, scale)
    x = torch.cat([torch.randn(11, 64, generator=g), 5 * w[-1:].expand(3, 64)])  # the last rows: the tie wins
    bias = torch.randn(out_features, generator=g)
    for n in (1, 2):
        with torch_threads(n):
            for b in (None, bias):
                expected = ops.int8_linear(x, packed, scale, b).argmax(-1)
                assert torch.equal(ops.int8_linear_argmax(x, packed, scale, b), expected)
                if b is None:  # equal rows, equal outputs: the first copy is the argmax
                    assert expected[-1] == out_features // 3
    assert ops.int8_linear_argmax(x, packed, scale, torch.full((out_features,), float("-inf"))).tolist() == [0] * 14
    nan_bias = bias.clone()
    nan_bias[out_features // 2 + 1] = float("nan")
    assert ops.int8_linear_argmax(x, packed, scale, nan_bias).tolist() == [-1] * 14
    linear = torch.nn.Linear(64, out_features)
    with torch.no_grad():
        linear.weight.copy_(w), linear.bias.copy_(nan_bias)
    head = Int8Linear(linear)
    assert torch.equal(head.argmax(x), head(x).argmax(-1))
    assert ops.int8_linear_argmax(x[:0], packed, scale, None).shape == (0,)


@needs_vnni_int8
def test_int8_linear_x_scale_quantizes_the_scaled_rows():
    """x_scale (SmoothQuant's 1 / s) is multiplied into each input before the row is quantized: the
    bits of the same call on x * x_scale, for the outputs and the argmax, at 1..19 rows."""
    w, scale, b, x = int8_case((37, 98), True, 19, seed=4)
    x_scale = torch.rand(98, generator=torch.Generator().manual_seed(5)) * 4 + 0.1
    packed = _pack_for_vnni(w, scale)
    expected = ops.int8_linear(x * x_scale, packed, scale, b)
    assert not torch.equal(expected, ops.int8_linear(x, packed, scale, b))
    for rows in range(1, 20):
        assert torch.equal(ops.int8_linear(x[:rows], packed, scale, b, x_scale), expected[:rows])
        assert torch.equal(ops.int8_linear_argmax(x[:rows], packed, scale, b, x_scale), expected[:rows].argmax(-1))
    with pytest.raises(RuntimeError, match="x_scale must be"):
        ops.int8_linear(x, packed, scale, b, x_scale[:97])


@needs_vnni_int8
def test_int8_linear_refuses_mismatched_shapes():
    w = torch.randn(32, 64)
    scale = w.abs().amax(1) / 127
    packed = _pack_for_vnni(w, scale)
    with pytest.raises(RuntimeError, match="packed weights take 64 inputs, x has 60"):
        ops.int8_linear(torch.zeros(2, 60), packed, scale, None)
    with pytest.raises(RuntimeError, match="w_scale must be"):
        ops.int8_linear(torch.zeros(2, 64), packed, scale[:8], None)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.int8_linear(torch.zeros(2, 64), packed, scale, torch.zeros(31))
    with pytest.raises(RuntimeError, match="float32"):
        ops.int8_linear(torch.zeros(2, 64, dtype=torch.float64), packed, scale, None)
    assert ops.int8_linear(torch.zeros(0, 64), packed, scale, None).shape == (0, 32)


def test_bad_calls_get_clear_errors():
    kc = vc = torch.zeros(2, 1, 16, 8)
    q = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="position outside the cache"):
        ops.cached_attention(q, kc, vc, torch.tensor([0]), torch.tensor([16]))
    with pytest.raises(RuntimeError, match="slot outside the cache"):
        ops.cached_attention(q, kc, vc, torch.tensor([2]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="float32"):
        ops.cached_attention(q.double(), kc, vc, torch.tensor([0]), torch.tensor([0]))



def test_key_counts_let_a_draft_block_see_itself_whole():
    """rope_cache_attention with key_counts: a block's rows are written at their own positions and each
    attends to as many keys as it is told (a draft block: the context and the whole block), exactly as
    causal attention of rows sitting at the block's last position."""
    heads, kv_heads, hd, context, block = 9, 3, 64, 37, 4
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(block, (heads + 2 * kv_heads) * hd, generator=g)
    positions, slots = torch.arange(context, context + block), torch.zeros(block, dtype=torch.long)
    cos, signed_sin = rope_tables(*Rotary(hd, 10000.0, None, 512).cos_sin(positions))
    kc = torch.zeros(1, kv_heads, 64, hd)
    kc[:, :, :context] = torch.randn(1, kv_heads, context, hd, generator=g)
    vc = kc.clone()
    counts = torch.full((block,), context + block)
    out = ops.rope_cache_attention(qkv, cos.view(block, hd), signed_sin.view(block, hd), kc, vc, slots, positions,
                                   heads, False, counts)
    q = apply_rope(qkv[:, :heads * hd].view(block, heads, hd), cos, signed_sin).contiguous()
    torch.testing.assert_close(out, ops.cached_attention(q, kc, vc, slots, counts - 1), rtol=1e-5, atol=2e-6)
    causal = ops.rope_cache_attention(qkv, cos.view(block, hd), signed_sin.view(block, hd), kc, vc, slots, positions,
                                      heads, False)
    assert torch.equal(causal[-1], out[-1]) and not torch.equal(causal[0], out[0])  # the last row sees it all anyway
    for bad in (torch.zeros(block, dtype=torch.long), torch.full((block,), 65)):
        with pytest.raises(RuntimeError, match="key count"):
            ops.rope_cache_attention(qkv, cos.view(block, hd), signed_sin.view(block, hd), kc, vc, slots, positions,
                                     heads, False, bad)

def test_markov_greedy_chain_is_the_torch_chain_with_its_ties_and_nans():
    g = torch.Generator().manual_seed(3)
    rows, slots, vocab = 3, 7, 50
    base = torch.randn(rows, slots, vocab, generator=g).round(decimals=1)  # coarse values: ties happen
    first = torch.randn(rows, vocab, generator=g).round(decimals=1)
    table = torch.randn(vocab, vocab, generator=g).round(decimals=1).bfloat16()
    base[2, 4, [7, 30]] = float("nan")  # torch.argmax takes the first NaN
    base[1, 2] = float("-inf")  # no sum above -inf: the first index

    def torch_chain():
        picks = [(base[:, 0] + first).argmax(-1)]
        for k in range(1, slots):
            picks.append((base[:, k] + table[picks[-1]]).argmax(-1))
        return torch.stack(picks, 1)

    got = ops.markov_greedy_chain(base, first, table)
    assert got.dtype == torch.long and torch.equal(got, torch_chain())
    assert got[2, 4] == 7 and got[1, 2] == 0
    with pytest.raises(RuntimeError, match="table"):
        ops.markov_greedy_chain(base, first, table.float())
