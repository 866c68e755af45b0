"""Serving precisions: kernels that are batch-invariant, close to fp32, and lossless under speculation."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dspark.engine.generate import Engine
from dspark.models import precision as prec
from dspark.models.batch import VarlenBatch
from dspark.models.loader import load_model
from dspark.sampling import SamplingParams
from dspark.speculative.engine import SpecEngine
from dspark.speculative.policy import FixedDraftLen
from tests.spec_helpers import random_drafter, tiny_target, with_gguf_blocks

# bf16's kernels exist only on CPUs with AVX-512 or AVX-NE-CONVERT; elsewhere bf16 is refused, which
# test_bf16_is_refused_where_the_cpu_has_no_kernels checks on every CPU.
FAST = ["int8", "int8-fbgemm", pytest.param("bf16", marks=pytest.mark.skipif(
    not prec.has_bf16_matmul(), reason="this CPU has no oneDNN bf16 kernels: bf16 is refused here")),
        *(pytest.param(name, marks=pytest.mark.skipif(
            not prec.has_gguf_matmul(), reason=f"no AVX2/FMA/F16C here: {name} is refused (tested below)"))
          for name in prec.GGUF_PRECISIONS)]


@pytest.fixture
def precision(request, monkeypatch):
    """The precision a test runs (parametrized indirectly from FAST). int8-fbgemm is int8 on FBGEMM,
    the kernel of CPUs without AVX-512 VNNI; int8 itself runs int8_matmul.cpp where they have it."""
    monkeypatch.delenv("DSPARK_INT8_KERNEL", raising=False)
    if request.param == "int8-fbgemm":
        monkeypatch.setenv("DSPARK_INT8_KERNEL", "fbgemm")  # read when a linear is converted
        return "int8"
    return request.param


def fast_linear(linear: nn.Linear, precision: str) -> nn.Module:
    """`linear` on the precision's kernel; under gguf and gguf-q8 first stored as a GGUF stores it
    (its weight becomes what the blocks hold, so it stays the reference)."""
    if precision in prec.GGUF_PRECISIONS:
        with_gguf_blocks(linear)
    return prec.convert_linear(linear, precision)


@pytest.mark.parametrize("precision", FAST, indirect=True)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_do_not_depend_on_their_batch(precision, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias)
    fast = fast_linear(linear, precision)
    x = torch.randn(33, 96)
    x[5] *= 40  # an outlier row must not change anyone else's quantization
    together = fast(x)
    alone = torch.cat([fast(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(together, alone)
    assert torch.equal(fast(x[3:11]), together[3:11])
    reference = linear(x)
    assert ((together - reference).norm() / reference.norm()) < 0.02


@pytest.mark.parametrize("precision", FAST, indirect=True)
@pytest.mark.parametrize("shape", [(576, 576), (49152, 576), (576, 1536)])  # SmolLM2's o, LM head, down
def test_a_row_keeps_its_bits_at_every_row_count(precision, shape):
    """Kernels switch algorithms by problem size (oneDNN on AMX does above 32 rows for some of these
    shapes): a row must come out the same in a call of any number of rows, prefill sizes included."""
    torch.manual_seed(1)
    out_features, in_features = shape
    fast = fast_linear(nn.Linear(in_features, out_features, bias=False), precision)
    x = torch.randn(300, in_features)
    alone = fast(x[:3])
    for rows in [1, 2, 5, 16, 31, 32, 33, 34, 40, 64, 65, 100, 129, 300]:
        assert torch.equal(fast(x[:rows])[:3], alone[:rows]), rows


def test_int8_keeps_7_bit_activations_where_8_would_saturate(monkeypatch):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200)
    x = torch.randn(17, 96)
    reference = linear(x)
    monkeypatch.setenv("DSPARK_INT8_KERNEL", "fbgemm")  # FBGEMM, the kernel of CPUs without AVX-512 VNNI
    fast = prec.Int8Linear(linear)
    assert fast.reduce_range == (not prec.has_vnni())
    fast.reduce_range = True  # the non-VNNI path, on any CPU
    assert ((fast(x) - reference).norm() / reference.norm()) < 0.02


def test_bf16_is_refused_where_the_cpu_has_no_kernels(monkeypatch):
    monkeypatch.setattr(prec, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))
    with pytest.raises(ValueError, match="bf16 needs a CPU with AVX-512"):
        prec.resolve_precision("bf16")
    assert prec.resolve_precision("auto") == "fp32"
    monkeypatch.setattr(prec, "cpu_flags", lambda: frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}))
    assert prec.resolve_precision("bf16") == "bf16"


def test_auto_precision_follows_the_cpu(monkeypatch):
    def flags(*names):
        monkeypatch.setattr(prec, "cpu_flags", lambda: frozenset(names))

    flags("avx512f", "avx512bw", "avx512vl", "avx512dq", "amx_bf16", "avx512_vnni")
    assert prec.resolve_precision("auto") == "int8"  # int8's kernel beats AMX bf16 at every batch size
    flags("avx512f", "avx512_vnni")
    assert prec.resolve_precision("auto") == "int8"
    flags("avx2", "fma", "f16c")
    assert prec.resolve_precision("auto") == "gguf-q8"
    monkeypatch.setenv("DSPARK_CPU_KERNELS", "0")  # no C++ kernels, no gguf matmul
    assert prec.resolve_precision("auto") == "fp32"
    monkeypatch.delenv("DSPARK_CPU_KERNELS")
    flags("avx", "sse4_2")
    assert prec.resolve_precision("auto") == "fp32"
    with pytest.raises(ValueError, match="gguf needs a CPU with AVX2"):
        prec.resolve_precision("gguf")
    assert prec.resolve_precision("int8") == "int8"
    with pytest.raises(ValueError, match="precision must be one of"):
        prec.resolve_precision("fp8")
    with pytest.raises(ValueError, match="runs on CPU kernels only"):
        prec.resolve_precision("gguf", "cuda")


@pytest.mark.parametrize("precision, kv_dtype", [("fp32", torch.float32), ("int8", torch.float32),
                                                  ("int8-fbgemm", torch.float32)], indirect=["precision"])
def test_the_kv_cache_keeps_fp32_under_fp32_and_int8_matmuls(precision, kv_dtype):
    """bf16 keeps a bf16 cache; int8 an fp32 one (a bf16 cache under int8 measured no faster through
    the services and moves its numerics). The bits tests here run through whichever it is."""
    model = tiny_target()
    model.set_precision(precision)
    assert model.new_cache(1, 8).k[0].dtype == kv_dtype


@pytest.mark.skipif(not prec.has_gguf_matmul(), reason="no AVX2/FMA/F16C here: gguf is refused (tested above)")
def test_gguf_blocks_hold_exactly_the_fp32_weights_the_checkpoint_loads():
    """The gguf precision is the fp32 model, not an approximation of it: every block type the
    default GGUF stores (Q4_1 layers, the Q8_0 embedding that is also the LM head) dequantizes in
    the kernel to the very fp32 weights the fp32 path multiplies by, q and k rows unpermuted."""
    from dspark.kernels.cpu import kernels

    model = load_model(precision="fp32").model
    model.set_precision("fp32")  # fuses q|k|v and gate|up: their blocks are stacked alike
    layer = model.model.layers[3]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
               model.lm_head]
    assert [linear.gguf_blocks.qtype for linear in linears] == [3, 3, 3, 3, 8]
    for linear in linears:
        dequantized = kernels().gguf_dequantize(linear.gguf_blocks.data, linear.gguf_blocks.qtype, linear.in_features)
        assert torch.equal(dequantized, linear.weight)


@pytest.mark.skipif(not prec.has_gguf_matmul(), reason="no AVX2/FMA/F16C here: gguf is refused (tested above)")
def test_under_gguf_a_target_without_blocks_stays_fp32_and_a_drafter_gets_q8_0_blocks():
    """A target from an HF checkpoint has no GGUF blocks: gguf leaves it fp32 and says so, rather
    than change the model. A drafter's weights may be approximated (it only proposes): they get
    Q8_0 blocks at load, its draft LM head too, and its logits stay close to fp32's."""
    assert tiny_target().set_precision("gguf") == "fp32"
    assert with_gguf_blocks(tiny_target()).set_precision("gguf") == "gguf"
    drafter = random_drafter(tiny_target(), "dspark")
    hidden = torch.randn(5, drafter.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    before = drafter.draft_logits(hidden)
    assert prec.apply_precision(drafter, "gguf") == "gguf"
    assert type(drafter.__dict__["_draft_head"]) is prec.GgufLinear
    # Blocks hold 32 inputs: a narrower matmul (the tiny drafter's W2 takes 16) stays fp32.
    assert not any(type(m) is nn.Linear and m.in_features % 32 == 0 for m in drafter.modules())
    assert any(type(m) is prec.GgufLinear for m in drafter.modules())
    after = drafter.draft_logits(hidden)
    assert not torch.equal(after, before) and torch.allclose(after, before, atol=0.02 * before.abs().max().item())
    assert not any("draft_head" in key for key in drafter.state_dict())


def test_fused_projections_keep_fp32_outputs():
    target = tiny_target(layers=3)
    batch = VarlenBatch.build([[5, 9, 11, 3], [7, 2]], [0, 0])
    before = target(batch, logits_rows="all").logits
    assert target.set_precision("fp32") == "fp32"
    assert hasattr(target.model.layers[0].self_attn, "qkv_proj") and hasattr(target.model.layers[0].mlp, "gate_up_proj")
    after = target(batch, logits_rows="all").logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def _logits_alone_and_batched(model, context: list[int], others: list[list[int]], n_new: int):
    """The logits of one sequence's verification pass alone and beside other sequences (varlen)."""
    new = context[-n_new:]
    results = []
    for neighbours in ([], others):
        cache = model.new_cache(1 + len(neighbours), 256)
        slots = [cache.allocate() for _ in range(1 + len(neighbours))]
        prompts = [context[:-n_new]] + [o[:-2] for o in neighbours]
        model(VarlenBatch.build(prompts, [0] * len(prompts), slots), cache)
        batch = VarlenBatch.build([new] + [o[-2:] for o in neighbours], [len(p) for p in prompts], slots)
        logits = model(batch, cache, logits_rows="all").logits
        results.append(logits[:n_new])
    return results


@pytest.mark.parametrize("precision", FAST, indirect=True)
def test_engine_pass_is_batch_invariant(precision):
    model = load_model(precision=precision).model  # the real default target
    g = torch.Generator().manual_seed(3)
    context = torch.randint(100, 20000, (40,), generator=g).tolist()
    others = [torch.randint(100, 20000, (n,), generator=g).tolist() for n in (12, 30, 7)]
    for n_new in (1, 5):
        alone, batched = _logits_alone_and_batched(model, context, others, n_new)
        assert torch.equal(alone, batched)


@pytest.mark.parametrize("precision", FAST, indirect=True)
@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_greedy_speculation_equals_plain_decoding_at_each_precision(precision, kind):
    target = with_gguf_blocks(tiny_target()) if precision in prec.GGUF_PRECISIONS else tiny_target()
    drafter = random_drafter(target, kind)
    assert target.set_precision(precision) == precision
    prec.apply_precision(drafter, precision)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    params = [SamplingParams(max_tokens=m) for m in (30, 22, 35, 16)]
    plain = Engine(target, max_batch=4, max_len=256).generate(prompts, params)
    engine = SpecEngine(target, drafter, FixedDraftLen(4), max_batch=4, max_len=256)
    spec = engine.generate(prompts, [SamplingParams(max_tokens=p.max_tokens) for p in params])
    assert [s.output for s in spec] == [s.output for s in plain]
    assert sum(s.spec.metrics.draft_tokens for s in spec) > 0


@pytest.mark.parametrize("precision", FAST[:3], indirect=True)
def test_a_drafters_lm_head_follows_its_precision_and_its_checkpoint_does_not_change(precision):
    """The draft LM head is a frozen buffer, not an nn.Linear: apply_precision still puts it on the
    precision's kernels (its logits then differ from fp32's by that precision's rounding only),
    off the module tree: nothing of it lands in a state dict."""
    drafter = random_drafter(tiny_target(), "dspark")
    hidden = torch.randn(5, drafter.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    fp32 = drafter.draft_logits(hidden)
    prec.apply_precision(drafter, precision)
    fast = drafter.draft_logits(hidden)
    assert type(drafter.__dict__["_draft_head"]).__name__ == {"bf16": "Bf16Linear", "int8": "Int8Linear"}[precision]
    assert not torch.equal(fast, fp32) and torch.allclose(fast, fp32, atol=0.05 * fp32.abs().max().item())
    assert not any("draft_head" in key for key in drafter.state_dict())


@pytest.mark.parametrize("precision", FAST, indirect=True)
def test_a_verification_pass_gives_each_row_the_bits_of_plain_decoding(precision):
    """Speculation is lossless only if verifying a block computes each row exactly as decoding it
    one token at a time would: int8 activation quantization turns last-bit differences into
    different tokens."""
    model = load_model(precision=precision).model
    g = torch.Generator().manual_seed(5)
    # positions 60..65: the block crosses a key bucket (64)
    prompt = torch.randint(100, 20000, (60,), generator=g).tolist()
    block = torch.randint(100, 20000, (6,), generator=g).tolist()
    cache = model.new_cache(2, 128)
    verify_slot, decode_slot = cache.allocate(), cache.allocate()
    model(VarlenBatch.build([prompt, prompt], [0, 0], [verify_slot, decode_slot]), cache)
    verified = model(VarlenBatch.build([block], [len(prompt)], [verify_slot]), cache, logits_rows="all").logits
    decoded = torch.cat([model(VarlenBatch.build([[t]], [len(prompt) + j], [decode_slot]), cache).logits
                         for j, t in enumerate(block)])
    assert torch.equal(verified, decoded)


@pytest.mark.parametrize("precision", FAST, indirect=True)
def test_a_prompt_row_has_the_bits_of_the_same_row_decoded(precision):
    """A resumed request re-reads what it already streamed as part of one prompt: each of those
    rows must come out as it did when it was decoded, or the resumed answer could differ."""
    model = load_model(precision=precision).model
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(100, 20000, (70,), generator=g).tolist()
    cache = model.new_cache(2, 128)
    whole_slot, split_slot = cache.allocate(), cache.allocate()
    whole = model(VarlenBatch.build([prompt], [0], [whole_slot]), cache, logits_rows="all").logits
    model(VarlenBatch.build([prompt[:50]], [0], [split_slot]), cache)
    decoded = torch.cat([model(VarlenBatch.build([[t]], [50 + j], [split_slot]), cache).logits
                         for j, t in enumerate(prompt[50:])])
    assert torch.equal(whole[50:], decoded)


@pytest.mark.parametrize("precision", FAST, indirect=True)
def test_a_pass_gives_the_same_bits_on_one_thread_and_on_two(precision):
    """The services run one thread each, a user's process as many as it has: a prompt's prefill and
    its decode rows must not depend on that, or the same request would answer differently. (fp32's
    MKL matmuls are neither batch- nor thread-invariant: it is the parity precision, not a serving one.)"""
    model = load_model(precision=precision).model
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(100, 20000, (70,), generator=g).tolist()
    block = torch.randint(100, 20000, (5,), generator=g).tolist()
    before = torch.get_num_threads()
    outputs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            cache = model.new_cache(1, 128)
            slot = cache.allocate()
            prefill = model(VarlenBatch.build([prompt], [0], [slot]), cache, logits_rows="all").logits
            verify = model(VarlenBatch.build([block], [len(prompt)], [slot]), cache, logits_rows="all").logits
            outputs.append((prefill, verify))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])


@pytest.mark.parametrize("precision", ["int8", pytest.param("gguf-q8", marks=pytest.mark.skipif(
    not prec.has_gguf_matmul(), reason="no AVX2/FMA/F16C here: gguf-q8 is refused"))], indirect=True)
def test_a_drafters_layers_in_one_call_draft_what_the_layer_loop_drafts(precision):
    """On the int8 (VNNI) and gguf-q8 kernels a parallel drafter runs its layers as the target's
    LayerStack (one C++ call): the same kernels in the same order as the Python loop over
    cached_forward, so the same hidden states bit for bit, and the same tokens and confidences."""
    target = tiny_target()
    drafter = random_drafter(target, "dspark")
    prec.apply_precision(drafter, precision)
    tokens = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(2))
    features = target(VarlenBatch.build([tokens.tolist()], [0]), capture_layers=drafter.ctx_layers,
                      logits_rows=None).features
    drafter.extend_context("a", features[:17], tokens[:17])
    drafter.extend_context("b", features[:9], tokens[:9])
    stacked = drafter._layer_stack()
    fused_kernels = all(getattr(m, "kernel", None) is not None for m in drafter.modules() if isinstance(m, prec.Int8Linear))
    assert (stacked is not None) == (precision == "gguf-q8" or fused_kernels)

    def draft():
        args = ["a", "b"], tokens[torch.tensor([17, 9])], torch.zeros(2), [None, None]
        return drafter.draft(*args), drafter.draft(*args, return_logits=True).logits

    (block, logits) = draft()
    drafter.__dict__["_stack"] = None  # the per-layer loop
    (looped, looped_logits) = draft()
    assert torch.equal(logits, looped_logits)
    assert torch.equal(block.tokens, looped.tokens) and torch.equal(block.conf_logits, looped.conf_logits)
