"""The CPU attention kernel alone: one layer of SmolLM2-135M's shape (9 query heads over 3 KV
heads of 64) for 1..8 new rows of one slot at a few context lengths, median microseconds a call,
and what that is for the 30 layers of a pass. What a verified block's extra rows cost in attention,
apart from the matmuls (docs/results.md, session 28).

    python benchmarks/attention_rows.py --contexts 300 512 2048 --rows 1 2 4 8
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from plotting import save_figure

from dspark.kernels.cpu import kernels
from dspark.models.threads import configure_threads

OUT = Path(__file__).resolve().parent / "results"
HEAD_DIM = 64  # the kernel's fast path (SmolLM2's heads)


def median_us(kernel, q, kc, vc, slots, positions, reps: int) -> float:
    for _ in range(20):
        kernel.cached_attention(q, kc, vc, slots, positions)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        kernel.cached_attention(q, kc, vc, slots, positions)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[300, 512, 2048])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default=str(OUT / "attention_rows.png"))
    args = ap.parse_args(argv)
    kernel = kernels()
    if kernel is None:
        raise SystemExit("the CPU kernels did not build here")
    threads = configure_threads()
    torch.manual_seed(0)
    max_len = max(args.contexts)
    kc, vc = (torch.randn(1, args.kv_heads, max_len, HEAD_DIM) for _ in range(2))
    results = {}
    print(f"{threads} threads; us a layer (ms for {args.layers} layers)")
    print(f"{'context':>8} " + " ".join(f"{f'{r} rows':>16}" for r in args.rows))
    for ctx in args.contexts:
        cells = []
        for rows in args.rows:
            q = torch.randn(rows, args.heads, HEAD_DIM)
            slots = torch.zeros(rows, dtype=torch.int64)
            positions = torch.arange(ctx - rows, ctx, dtype=torch.int64)
            us = median_us(kernel, q, kc, vc, slots, positions, args.reps)
            results[(ctx, rows)] = us
            cells.append(f"{us:7.1f} ({us * args.layers / 1e3:5.2f})")
        print(f"{ctx:>8} " + " ".join(f"{c:>16}" for c in cells), flush=True)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for ctx in args.contexts:
        ax.plot(args.rows, [results[(ctx, r)] * args.layers / 1e3 for r in args.rows], marker="o", label=f"{ctx} keys")
    ax.set_xlabel("new rows of one request")
    ax.set_ylabel(f"attention, ms for {args.layers} layers")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, args.out)


if __name__ == "__main__":
    main()
