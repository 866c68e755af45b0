"""How far each serving precision is from fp32, on the evaluation prompts.

    python benchmarks/precision_quality.py [--prompts-per-dataset 6] [--tokens 64]

The text: each eval prompt (first turn, chat template) and the fp32 target's greedy answer to it.
Every precision then reads that same text in one teacher-forced pass: top-1 agreement is the
share of answer positions where its next-token argmax equals fp32's; perplexity is over the answer
tokens. Prints a table per dataset and writes benchmarks/results/precision_quality.png.
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
from plotting import grouped_bars, save_figure

from dspark.engine.generate import Engine
from dspark.models.batch import VarlenBatch
from dspark.models.loader import load_model
from dspark.models.threads import configure_threads
from dspark.sampling import SamplingParams
from dspark.train.evaluate import DATASETS, EVAL_DIR, load_eval_prompts

OUT = Path(__file__).resolve().parent / "results"


def teacher_forced(model, prompt: list[int], answer: list[int], kv_dtype=None) -> torch.Tensor:
    """Logits [len(answer), V] predicting each answer token from everything before it, through a
    KV cache as serving computes them (its dtype and attention kernel included; kv_dtype: another
    cache dtype than serving's)."""
    tokens = prompt + answer
    rows = torch.arange(len(prompt) - 1, len(tokens) - 1)
    cache = model.new_cache(1, len(tokens), dtype=kv_dtype)
    with torch.no_grad():
        return model(VarlenBatch.build([tokens], [0], [cache.allocate()]), cache, logits_rows=rows).logits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts-per-dataset", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--precisions", default="bf16,int8,int8-bf16kv",
                    help="comma-separated; int8-fbgemm = int8 on FBGEMM; int8-nosmooth = int8 without "
                         "SmoothQuant's scales; a -bf16kv suffix: a bf16 KV cache instead of serving's (fp32 "
                         "under int8)")
    ap.add_argument("--eval-dir", type=Path, default=EVAL_DIR)
    args = ap.parse_args()
    configure_threads()
    reference = load_model(precision="fp32")
    tok = reference.tokenizer
    texts = {}
    for name in DATASETS:
        prompts = [tok.encode_chat([{"role": "user", "content": p}])
                   for p in load_eval_prompts(name, args.prompts_per_dataset, args.eval_dir)]
        engine = Engine(reference.model, max_batch=len(prompts), max_len=2048)
        with torch.no_grad():
            answers = [s.output for s in engine.generate(prompts, SamplingParams(max_tokens=args.tokens))]
        texts[name] = list(zip(prompts, answers))
        print(f"{name}: {len(prompts)} prompts, {sum(map(len, answers))} answer tokens", flush=True)

    # name -> (model, KV cache dtype or None for serving's); a -bf16kv contender reuses its base model
    contenders, loaded = {"fp32": (reference.model, None)}, {}
    for precision in args.precisions.split(","):
        base = precision.removesuffix("-bf16kv")
        if base not in loaded:
            # int8-fbgemm: int8 on FBGEMM's kernel (CPUs without AVX-512 VNNI), read when the model is built
            os.environ["DSPARK_INT8_KERNEL"] = "fbgemm" if base == "int8-fbgemm" else "vnni"
            loaded[base] = load_model(precision=base.removesuffix("-fbgemm").removesuffix("-nosmooth"),
                                      int8_smoothing=not base.endswith("-nosmooth")).model
        contenders[precision] = (loaded[base], torch.bfloat16 if precision != base else None)
    models = list(contenders)
    table = {}
    for name, pairs in texts.items():
        # fp32's own next-token choices, once per answer for every contender
        ref_tops = [teacher_forced(reference.model, prompt, answer).argmax(-1) for prompt, answer in pairs]
        for precision, (model, kv_dtype) in contenders.items():
            agree = nll = count = 0
            for (prompt, answer), ref_top in zip(pairs, ref_tops):
                logits = teacher_forced(model, prompt, answer, kv_dtype)
                target = torch.tensor(answer)
                agree += int((logits.argmax(-1) == ref_top).sum())
                nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
                count += len(answer)
            table[(name, precision)] = (agree / count, math.exp(nll / count))

    print("\nTeacher-forced on fp32's greedy answers: top-1 agreement with fp32 / perplexity")
    width = max(map(len, models)) + 8
    print(f"{'dataset':<12}" + "".join(f"{p + ' agree':>{width}}{p + ' ppl':>{width}}" for p in models))
    for name in texts:
        print(f"{name:<12}" + "".join(f"{table[(name, p)][0]:>{width}.3f}{table[(name, p)][1]:>{width}.3f}" for p in models))
    mean = {p: [sum(table[(n, p)][i] for n in texts) / len(texts) for i in (0, 1)] for p in models}
    print(f"{'mean':<12}" + "".join(f"{mean[p][0]:>{width}.3f}{mean[p][1]:>{width}.3f}" for p in models))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (ax, title) in enumerate(((a, "top-1 agreement with fp32"), (b, "perplexity of fp32's answers"))):
        grouped_bars(ax, list(texts), {p: [table[(n, p)][i] for n in texts] for p in models})
        ax.set_title(title)
    a.set_ylim(0.8, 1.0)
    save_figure(fig, OUT / "precision_quality.png")


if __name__ == "__main__":
    main()
