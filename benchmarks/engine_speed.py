"""Target engine speed on this machine, per serving precision: plain decoding at batch 1/8/32
vs transformers vs llama.cpp on the same GGUF, the verification-cost curve (one pass with n new
tokens on a 512-token context), and each shipped drafter's time for one block.

    pip install -e ".[bench]"   # llama-cpp-python, built from source (~10 min here)
    python benchmarks/engine_speed.py [--tokens 64] [--precisions fp32-sdpa,fp32,bf16,int8] [--skip-llamacpp]

Prints three tables and writes benchmarks/results/engine_speed.png. All contenders run in this
one process, one after another, on the same prompts, so their ratios are comparable.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from pathlib import Path

import torch
from plotting import grouped_bars, save_figure

from dspark.drafters.shipped import load_drafter_for
from dspark.engine.generate import Engine
from dspark.models.batch import VarlenBatch
from dspark.models.loader import default_gguf_path, load_model
from dspark.models.threads import configure_threads
from dspark.sampling import SamplingParams

OUT = Path(__file__).resolve().parent / "results"
QUESTIONS = ["Explain how a hash map works.", "Write a short poem about autumn.", "What causes rain?",
             "Give three tips for learning a language.", "Describe the water cycle.", "What is recursion?",
             "Summarise the plot of a heist movie.", "How do vaccines work?"]
QUESTIONS = [f"{q} (variant {i})" if i else q for i in range(4) for q in QUESTIONS]  # 32 prompts


BEFORE_KERNELS = "-sdpa"  # e.g. fp32-sdpa: the model as it ran before dspark/kernels (torch SDPA and norm)
ON_FBGEMM = "-fbgemm"  # int8-fbgemm: int8 on FBGEMM's dynamic linear, as before int8_matmul.cpp
NO_AMX = "-noamx"  # int8-noamx: int8_matmul.cpp on VNNI only, its AMX tiles off (the same bits)
NO_SMOOTH = "-nosmooth"  # int8-nosmooth: int8 without SmoothQuant's scales (dspark/models/int8_smoothing.py)


def set_cpu_kernels(on: bool) -> None:
    os.environ["DSPARK_CPU_KERNELS"] = "1" if on else "0"  # read at every pass


def ours(loaded, prompts, new_tokens):
    engine = Engine(loaded.model, max_batch=len(prompts), max_len=1024, eos_ids=())
    engine.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up: first-call allocations
    start = time.perf_counter()
    with torch.no_grad():
        seqs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens))
    return sum(len(s.output) for s in seqs) / (time.perf_counter() - start)


def draft_block_ms(loaded, kind: str, precision: str, context=512, repeats=5):
    """One drafter's time for one block (its gamma) after a 512-token context, batch 1."""
    drafter = load_drafter_for(loaded, kind, precision)
    if drafter is None:
        return None
    model = loaded.model
    tokens = list(range(10, 10 + context))
    with torch.no_grad():
        out = model(VarlenBatch.build([tokens], [0]), capture_layers=tuple(drafter.ctx_layers), logits_rows=None)
        drafter.extend_context("r", out.features.float(), torch.tensor(tokens))
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            drafter.draft(["r"], torch.tensor([tokens[-1]]), torch.zeros(1), [torch.Generator()])
            times.append(time.perf_counter() - start)
    return drafter.gamma, statistics.median(times[1:]) * 1e3


def transformers_generate(hf, prompts, new_tokens):
    # left-padded batch, greedy, no early stop: the same work as ours
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0)
    return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - start)


def llamacpp(prompts, new_tokens, repacked=False):
    """llama.cpp on the same GGUF, fed the same token ids: one llama_decode per step over every
    sequence of the batch (its own KV sequence each), greedy, through llama-cpp-python's C API.
    repacked: its AMX/repacked weight buffers, which crash on a decode of more than one token in
    this build, so the prompt goes in one token at a time (batch 1 only): its fastest decoding."""
    import llama_cpp as lc
    import numpy as np

    lc.llama_backend_init()
    lc.llama_log_set(_quiet, ctypes.c_void_p(0))
    model_params = lc.llama_model_default_params()
    # Without this, llama_decode of a batch of more than one token segfaults on an AMX CPU (0.3.36,
    # built here; its AMX/repacked weight buffers): the plain CPU buffers run everywhere.
    model_params.use_extra_bufts = repacked
    model = lc.llama_model_load_from_file(str(default_gguf_path()).encode(), model_params)
    params = lc.llama_context_default_params()
    params.n_ctx = len(prompts) * (max(map(len, prompts)) + new_tokens + 8)
    params.n_batch = params.n_ubatch = max(512, sum(map(len, prompts)))
    params.n_seq_max = len(prompts)
    params.n_threads = params.n_threads_batch = torch.get_num_threads()
    ctx = lc.llama_init_from_model(model, params)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(params.n_batch, 0, len(prompts))

    def decode(items):  # (token, position, sequence, wants logits) -> greedy next token per wanted row
        batch.n_tokens = len(items)
        for i, (token, pos, seq, wants) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, wants
            batch.seq_id[i][0] = seq
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.argmax(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))
                for i, item in enumerate(items) if item[3]]

    try:
        start = time.perf_counter()
        prompt_rows = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        for chunk in ([[row] for row in prompt_rows] if repacked else [prompt_rows]):
            last = decode(chunk)  # the last chunk holds each prompt's last row
        for step in range(new_tokens - 1):
            last = decode([(t, len(p) + step, s, True) for s, (t, p) in enumerate(zip(last, prompts))])
        return len(prompts) * new_tokens / (time.perf_counter() - start)
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)


def _quiet_log(level, text, user_data):
    pass


try:  # llama.cpp's log callback; kept referenced for the life of the process
    import llama_cpp as _lc

    _quiet = _lc.llama_log_callback(_quiet_log)
except ImportError:
    _quiet = None


def verification_curve(model, context=512, sizes=(1, 2, 4, 8, 16, 32), rounds=9):
    """Median ms of one pass per n. Sizes take turns within each round, so a noisy moment on this
    shared machine hits every size alike instead of skewing one of them."""
    cache = model.new_cache(1, context + 64)
    slot = cache.allocate()
    times = {n: [] for n in sizes}
    with torch.no_grad():
        model(VarlenBatch.build([list(range(10, 10 + context))], [0], [slot]), cache)
        for round_ in range(rounds + 1):
            for n in sizes:
                cache.rollback(slot, context)
                start = time.perf_counter()
                model(VarlenBatch.build([[7] * n], [context], [slot]), cache, logits_rows="all")
                if round_:  # the first round warms up
                    times[n].append(time.perf_counter() - start)
    return [(n, statistics.median(times[n])) for n in sizes]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--precisions", default="fp32-sdpa,fp32,bf16,int8",
                    help=f"comma-separated; a {BEFORE_KERNELS} suffix runs that precision without dspark/kernels, "
                         f"int8{ON_FBGEMM} runs int8 on FBGEMM instead of int8_matmul.cpp, int8{NO_AMX} without "
                         "its AMX tiles")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    threads = configure_threads()
    precisions, batches = args.precisions.split(","), [int(b) for b in args.batches.split(",")]
    tok = load_model().tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]

    results, curves, drafts = {}, {}, {}
    for precision in precisions:
        set_cpu_kernels(not precision.endswith(BEFORE_KERNELS))
        os.environ["DSPARK_INT8_KERNEL"] = "fbgemm" if precision.endswith(ON_FBGEMM) else "vnni"  # read at load
        os.environ["DSPARK_INT8_AMX"] = "0" if precision.endswith(NO_AMX) else "1"
        kernels_of = precision
        for suffix in (BEFORE_KERNELS, ON_FBGEMM, NO_AMX, NO_SMOOTH):
            kernels_of = kernels_of.removesuffix(suffix)
        loaded = load_model(precision=kernels_of, int8_smoothing=not precision.endswith(NO_SMOOTH))
        print(f"[{precision}] decoding ...", flush=True)
        for batch in batches:
            results[(f"dspark {precision}", batch)] = ours(loaded, prompts[:batch], args.tokens)
        print(f"[{precision}] verification curve and drafters ...", flush=True)
        curves[precision] = verification_curve(loaded.model)
        for kind in ("dspark", "dflash", "eagle3"):
            drafts[(precision, kind)] = draft_block_ms(loaded, kind, loaded.model.precision)
        del loaded
        set_cpu_kernels(True)
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        path = default_gguf_path()
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        for batch in batches:
            print(f"[transformers] batch {batch} ...", flush=True)
            results[("transformers fp32", batch)] = transformers_generate(hf, prompts[:batch], args.tokens)
        del hf
    if not args.skip_llamacpp and _quiet is not None:
        for batch in batches:
            results[("llama.cpp Q4_1", batch)] = llamacpp(prompts[:batch], args.tokens)
        if 1 in batches:
            results[("llama.cpp Q4_1 AMX", 1)] = llamacpp(prompts[:1], args.tokens, repacked=True)
    if not args.skip_llamacpp and _quiet is None:
        print("llama-cpp-python not installed: pip install -e '.[bench]' (builds from source, ~10 min)")

    print(f"\nAutoregressive decoding, SmolLM2-135M, {args.tokens} new tokens, {threads} threads (tokens/s)")
    engines = list(dict.fromkeys(name for name, _ in results))
    print(f"{'engine':<20}" + "".join(f"{'batch ' + str(b):>10}" for b in batches))
    for name in engines:
        print(f"{name:<20}" + "".join(f"{results.get((name, b), float('nan')):>10.1f}" for b in batches))

    sizes = [n for n, _ in next(iter(curves.values()))]
    print("\nVerification cost: one target pass with n new tokens on a 512-token context (ms; x = vs n=1)")
    print(f"{'n':>4}" + "".join(f"{p + ' ms':>11}{'x':>6}" for p in precisions))
    for i, n in enumerate(sizes):
        print(f"{n:>4}" + "".join(f"{curves[p][i][1] * 1e3:>11.1f}{curves[p][i][1] / curves[p][0][1]:>6.2f}"
                                  for p in precisions))

    print("\nOne draft block (batch 1, 512-token context), next to the target's 1-token and gamma+1-token passes (ms)")
    print(f"{'precision':<10}{'drafter':<8}{'gamma':>6}{'block ms':>10}{'target n=1':>12}{'target n=8':>12}")
    for (precision, kind), value in drafts.items():
        if value is None:
            continue
        gamma, ms = value
        curve = dict(curves[precision])
        print(f"{precision:<10}{kind:<8}{gamma:>6}{ms:>10.1f}{curve[1] * 1e3:>12.1f}{curve[8] * 1e3:>12.1f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    grouped_bars(a, [f"batch {b}" for b in batches],
                 {name: [results.get((name, b), float("nan")) for b in batches] for name in engines})
    a.set_ylabel("tokens/s")
    a.set_title(f"Plain decoding, SmolLM2-135M ({threads} CPU threads)")
    for precision, curve in curves.items():
        b.plot([n for n, _ in curve], [s * 1e3 for _, s in curve], marker="o", label=precision)
    b.set_xscale("log", base=2)
    b.set_xlabel("new tokens in the pass (512-token context)")
    b.set_ylabel("ms per pass")
    b.set_title("Verification cost curve")
    b.legend()
    save_figure(fig, OUT / "engine_speed.png")


if __name__ == "__main__":
    main()
