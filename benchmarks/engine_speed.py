"""Target engine speed on this machine: plain decoding vs transformers vs llama.cpp, and the
verification-cost curve (one pass with n new tokens on a 512-token context).

    pip install -e ".[bench]"   # llama-cpp-python, built from source (~10 min here)
    python benchmarks/engine_speed.py [--tokens 64] [--skip-llamacpp]

Prints two tables and writes benchmarks/results/engine_speed.png. All contenders run in this
one process, one after another, on the same prompts, so their ratios are comparable.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import torch

from dspark.engine.batch import VarlenBatch
from dspark.engine.generate import Engine
from dspark.models.loader import default_gguf_path, load_model
from dspark.sampling import SamplingParams

OUT = Path(__file__).resolve().parent / "results"
QUESTIONS = ["Explain how a hash map works.", "Write a short poem about autumn.", "What causes rain?",
             "Give three tips for learning a language.", "Describe the water cycle.", "What is recursion?",
             "Summarise the plot of a heist movie.", "How do vaccines work?"]


def ours(loaded, prompts, new_tokens):
    engine = Engine(loaded.model, max_batch=len(prompts), max_len=1024, eos_ids=())
    start = time.perf_counter()
    seqs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens))
    return sum(len(s.output) for s in seqs) / (time.perf_counter() - start)


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


def llamacpp(prompts, new_tokens):
    """llama.cpp on the same GGUF, fed the same token ids: one llama_decode per step over every
    sequence of the batch (its own KV sequence each), greedy, through llama-cpp-python's C API."""
    import llama_cpp as lc
    import numpy as np

    lc.llama_backend_init()
    lc.llama_log_set(_quiet, ctypes.c_void_p(0))
    model = lc.llama_model_load_from_file(str(default_gguf_path()).encode(), lc.llama_model_default_params())
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
        last = decode([(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)])
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


def verification_curve(model, context=512, sizes=(1, 2, 4, 8, 16, 32), repeats=5):
    cache = model.new_cache(1, context + 64)
    slot = cache.allocate()
    model(VarlenBatch.build([list(range(10, 10 + context))], [0], [slot]), cache)
    rows = []
    for n in sizes:
        times = []
        for _ in range(repeats):
            cache.rollback(slot, context)
            start = time.perf_counter()
            model(VarlenBatch.build([[7] * n], [context], [slot]), cache, logits_rows="all")
            times.append(time.perf_counter() - start)
        rows.append((n, statistics.median(times)))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--skip-llamacpp", action="store_true")
    args = ap.parse_args()
    loaded = load_model()
    tok = loaded.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

    results = {}
    for batch in (1, 8):
        group = prompts[:batch]
        results[("dspark engine", batch)] = ours(loaded, group, args.tokens)
        results[("transformers", batch)] = transformers_generate(hf, group, args.tokens)
        if not args.skip_llamacpp and _quiet is not None:
            results[("llama.cpp (Q4_1)", batch)] = llamacpp(group, args.tokens)
    if not args.skip_llamacpp and _quiet is None:
        print("llama-cpp-python not installed: pip install -e '.[bench]' (builds from source, ~10 min)")
    print(f"\nAutoregressive decoding, SmolLM2-135M, {args.tokens} new tokens, {torch.get_num_threads()} threads")
    print(f"{'engine':<20}{'batch':>6}{'tokens/s':>10}")
    for (name, batch), tps in results.items():
        print(f"{name:<20}{batch:>6}{tps:>10.1f}")

    curve = verification_curve(loaded.model)
    print("\nVerification cost: one target pass with n new tokens on a 512-token context")
    print(f"{'n':>4}{'ms':>9}{'x (n=1)':>9}")
    for n, sec in curve:
        print(f"{n:>4}{sec * 1e3:>9.1f}{sec / curve[0][1]:>9.2f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    engines = list(dict.fromkeys(name for name, _ in results))
    batches = sorted({batch for _, batch in results})
    width = 0.8 / len(engines)
    for i, name in enumerate(engines):
        xs = [j + i * width for j, batch in enumerate(batches) if (name, batch) in results]
        a.bar(xs, [results[(name, batch)] for batch in batches if (name, batch) in results], width, label=name)
    a.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
    a.set_ylabel("tokens/s")
    a.set_title(f"Plain decoding, SmolLM2-135M ({torch.get_num_threads()} CPU threads)")
    a.legend()
    b.plot([n for n, _ in curve], [s * 1e3 for _, s in curve], marker="o")
    b.set_xscale("log", base=2)
    b.set_xlabel("new tokens in the pass (512-token context)")
    b.set_ylabel("ms per pass")
    b.set_title("Verification cost curve")
    fig.tight_layout()
    OUT.mkdir(exist_ok=True)
    fig.savefig(OUT / "engine_speed.png", dpi=120)
    print(f"\nplot: {OUT / 'engine_speed.png'}")


if __name__ == "__main__":
    main()
