"""The measurements scripts/gpu_check.sh prints, one subcommand each; every one runs on
`--device cpu` too (that is how they are checked on machines without a GPU).

    python benchmarks/gpu_check.py parity   --device cuda   # fp32 target on the device vs on the CPU
    python benchmarks/gpu_check.py identity --device cuda   # greedy: speculative = plain, per precision
    python benchmarks/gpu_check.py curve    --device cuda   # one verification pass with n = 1..64 new tokens
    python benchmarks/gpu_check.py speed    --device cuda   # single-stream tokens/s, plain vs DSpark

Each prints a few lines starting with the subcommand's name; none writes a file.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from dspark.device import add_device_flag, describe, device_or_exit, synchronize
from dspark.drafters.shipped import load_drafter_for
from dspark.engine.generate import Engine
from dspark.models.batch import VarlenBatch
from dspark.models.loader import DEFAULT_MODEL, load_model
from dspark.sampling import SamplingParams
from dspark.speculative.engine import SpecEngine
from dspark.speculative.policy import FixedDraftLen

QUESTIONS = ["Explain how a hash map works.", "Write a short poem about autumn.", "What causes rain?",
             "Give three tips for learning a language.", "Describe the water cycle.", "What is recursion?",
             "How do vaccines work?", "Summarise the plot of a heist movie."]


def chat_prompts(loaded, count: int) -> list[list[int]]:
    return [loaded.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS[:count]]


@torch.no_grad()
def parity(args, device: torch.device) -> None:
    """Max |logit difference| of the fp32 target on `device` vs the fp32 target on the CPU, over
    every prompt row (prefill) and a few cached decode rows."""
    host = load_model(args.model, precision="fp32")
    there = load_model(args.model, device=device, precision="fp32")
    worst, rows, same_top1 = 0.0, 0, 0
    for prompt in chat_prompts(host, args.prompts):
        logits = []
        for loaded in (host, there):
            cache = loaded.model.new_cache(1, len(prompt) + 8)
            slot = cache.allocate()
            first = loaded.model(VarlenBatch.build([prompt], [0], [slot]), cache, logits_rows="all").logits
            decoded = [loaded.model(VarlenBatch.build([[t]], [len(prompt) + i], [slot]), cache).logits
                       for i, t in enumerate(prompt[:4])]
            logits.append(torch.cat([first, *decoded]).cpu())
        worst = max(worst, float((logits[0] - logits[1]).abs().max()))
        same_top1 += int((logits[0].argmax(-1) == logits[1].argmax(-1)).sum())
        rows += logits[0].shape[0]
    print(f"parity: fp32 {describe(device)} vs cpu: max |logit diff| = {worst:.3g} over {rows} rows "
          f"(logits of magnitude ~{float(logits[0].abs().max()):.0f}); top-1 agrees on {same_top1}/{rows}")


def _generate(engine, prompts, max_tokens):
    seqs = [engine.add(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    while engine.has_work():
        engine.step()
    return seqs


@torch.no_grad()
def identity(args, device: torch.device) -> None:
    """Greedy speculative decoding (shipped DSpark drafter, whole block verified) against plain
    decoding on the same device and precision, all prompts in one batch."""
    for precision in args.precisions.split(","):
        loaded = load_model(args.model, device=device, precision=precision)
        drafter = load_drafter_for(loaded, "dspark", precision)
        prompts = chat_prompts(loaded, args.prompts)
        plain = _generate(Engine(loaded.model, max_batch=len(prompts), max_len=1024), prompts, args.max_tokens)
        spec = _generate(SpecEngine(loaded.model, drafter, FixedDraftLen(drafter.gamma), max_batch=len(prompts),
                                    max_len=1024), prompts, args.max_tokens)
        same = sum(p.output == s.output for p, s in zip(plain, spec))
        first_diff = [next((i for i, (a, b) in enumerate(zip(p.output, s.output)) if a != b), None)
                      for p, s in zip(plain, spec)]
        drafted = sum(s.spec.metrics.draft_tokens for s in spec)
        accepted = sum(s.spec.metrics.accepted_tokens for s in spec)
        print(f"identity: {describe(device)} {loaded.model.precision}: {same}/{len(prompts)} greedy outputs identical "
              f"(speculative vs plain, {args.max_tokens} tokens each; {accepted}/{drafted} draft tokens accepted)"
              + ("" if same == len(prompts) else f"; first differing token per prompt: {first_diff}"))


@torch.no_grad()
def curve(args, device: torch.device) -> None:
    """Median time of one verification pass with n new tokens after a 512-token context; sizes
    take turns within each round so a noisy moment hits them alike."""
    loaded = load_model(args.model, device=device, precision=args.precision)
    model, context = loaded.model, 512
    sizes = [int(n) for n in args.sizes.split(",")]
    cache = model.new_cache(1, context + max(sizes) + 8)
    slot = cache.allocate()
    model(VarlenBatch.build([list(range(10, 10 + context))], [0], [slot], device=device), cache)
    times = {n: [] for n in sizes}
    for round_ in range(args.rounds + 1):
        for n in sizes:
            cache.rollback(slot, context)
            batch = VarlenBatch.build([[7] * n], [context], [slot], device=device)
            synchronize(device)
            start = time.perf_counter()
            model(batch, cache, logits_rows="all")
            synchronize(device)
            if round_:  # the first round warms up
                times[n].append(time.perf_counter() - start)
    ms = {n: statistics.median(times[n]) * 1e3 for n in sizes}
    print(f"curve: {describe(device)} {model.precision}, one pass after {context} tokens (median of {args.rounds}):")
    print("curve:   n  " + "".join(f"{n:>8}" for n in sizes))
    print("curve:   ms " + "".join(f"{ms[n]:>8.2f}" for n in sizes))
    if 4 in ms and 16 in ms:
        print(f"curve: n=16 costs {ms[16] / ms[4]:.3f}x n=4 (the paper's GPU claim: within ~1%)")


@torch.no_grad()
def speed(args, device: torch.device) -> None:
    """Single-stream tokens/s: plain decoding vs DSpark (shipped drafter) at k = 1, 3 and its block."""
    loaded = load_model(args.model, device=device, precision=args.precision)
    drafter = load_drafter_for(loaded, "dspark", args.precision)
    prompts = chat_prompts(loaded, args.prompts)
    runs = [("plain", None, 0)] + [(f"dspark k={k}", drafter, k) for k in (1, 3, drafter.gamma)]
    for name, d, k in runs:
        engine = SpecEngine(loaded.model, d, FixedDraftLen(k), max_batch=1, max_len=1024)
        _generate(engine, prompts[:1], 4)  # warm-up: first-call allocations, kernels
        tokens, seconds, taus = 0, 0.0, []
        for prompt in prompts:
            synchronize(device)
            start = time.perf_counter()
            (seq,) = _generate(engine, [prompt], args.max_tokens)
            seconds += time.perf_counter() - start
            tokens += len(seq.output)
            taus.append(seq.spec.metrics.acceptance_length)
        print(f"speed: {describe(device)} {loaded.model.precision} {name:<12} {tokens / seconds:8.1f} tokens/s "
              f"(tau {statistics.mean(taus):.2f}, {tokens} tokens, {len(prompts)} prompts one at a time)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("check", choices=["parity", "identity", "curve", "speed"])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    add_device_flag(ap)
    ap.add_argument("--precision", default="auto", help="curve and speed")
    ap.add_argument("--precisions", default="fp32,auto", help="identity: each in turn")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64", help="curve: new tokens per pass")
    ap.add_argument("--rounds", type=int, default=20, help="curve: timed rounds")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    check = {"parity": parity, "identity": identity, "curve": curve, "speed": speed}[args.check]
    check(args, device_or_exit(args.device, "gpu_check"))


if __name__ == "__main__":
    main()
