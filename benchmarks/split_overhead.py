"""What splitting into services costs: tokens/s and tau through drafter + verifier + scheduler
processes vs the same SpecEngine in one process (same model, drafter, prompts, same run), plus
the bytes per step on the verifier-drafter link.

    python benchmarks/split_overhead.py [--prompts 8] [--max-tokens 48] [--out benchmarks/split_overhead.png]

The drafter is the shipped checkpoint drafters/<model>/dspark if present, else the same random
DSpark drafter the drafter service builds (same seed), so both sides run identical weights.
Greedy decoding, all prompts submitted at once (one running batch).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

TOPICS = ["the moon", "rivers", "bread", "chess", "volcanoes", "owls", "the ocean", "trains", "music", "glass",
          "bees", "winter", "maps", "clocks", "salt", "bridges"]


def in_process(model_name: str, checkpoint: str, messages, max_tokens: int) -> dict:
    import torch

    from drafter_svc.__main__ import load, parse_args
    from dspark.models.loader import load_model
    from dspark.sampling import SamplingParams
    from dspark.speculative.engine import SpecEngine
    from dspark.speculative.policy import FixedDraftLen

    torch.set_grad_enabled(False)
    loaded = load_model(model_name)
    drafter, _ = load(parse_args([f"--checkpoint={checkpoint}", f"--target-model={model_name}"]))
    engine = SpecEngine(loaded.model, drafter, FixedDraftLen(drafter.gamma), max_batch=len(messages), max_len=1024)
    prompts = [loaded.tokenizer.encode_chat(m) for m in messages]
    start = time.perf_counter()
    seqs = [engine.add(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    while engine.has_work():
        engine.step()
    elapsed = time.perf_counter() - start
    tokens = sum(len(s.output) for s in seqs)
    drafts = sum(s.spec.metrics.drafts for s in seqs)
    accepted = sum(s.spec.metrics.accepted_tokens for s in seqs)
    return dict(tokens=tokens, seconds=elapsed, tps=tokens / elapsed, tau=1 + accepted / drafts if drafts else 1.0,
                outputs=[s.output for s in seqs], kind=drafter.kind, version=drafter.version)


def split(model_name: str, checkpoint: str, messages, max_tokens: int, log_dir: Path) -> dict:
    from service_helpers import (
        StreamThread,
        free_port,
        start_drafter,
        start_scheduler,
        start_verifier,
        wait_registered,
        wait_serving,
    )

    metrics_port = free_port()
    drafter, d_addr = start_drafter(model_name, log_dir, checkpoint=checkpoint, gamma=7, num_layers=2)
    scheduler, s_addr = start_scheduler(log_dir, [])
    verifier, v_addr = start_verifier(model_name, log_dir, d_addr, s_addr, max_len=1024, drafter_timeout_s=30,
                                      metrics_port=metrics_port)
    services = (verifier, scheduler, drafter)
    try:
        for service, address in zip(services, (v_addr, s_addr, d_addr)):
            wait_serving(address, service, timeout=600)
        wait_registered(s_addr, 1)
        # Warm-up request (first-call allocations), not measured.
        StreamThread(s_addr, prompt="Hi", max_tokens=4).result(timeout=600)
        before = scrape(metrics_port)
        start = time.perf_counter()
        streams = [StreamThread(s_addr, messages=m, max_tokens=max_tokens) for m in messages]
        results = [s.result(timeout=1800) for s in streams]
        elapsed = time.perf_counter() - start
        after = scrape(metrics_port)
    finally:
        for service in services:
            service.terminate(30)
    tokens = sum(len(r.token_ids) for r in results)
    drafts = sum(r.metrics.drafts for r in results)
    accepted = sum(r.metrics.accepted_tokens for r in results)
    steps = after["dspark_drafter_link_bytes_per_step_count"] - before["dspark_drafter_link_bytes_per_step_count"]
    link = after["dspark_drafter_link_bytes_per_step_sum"] - before["dspark_drafter_link_bytes_per_step_sum"]
    return dict(tokens=tokens, seconds=elapsed, tps=tokens / elapsed, tau=1 + accepted / drafts if drafts else 1.0,
                outputs=[list(r.token_ids) for r in results], bytes_per_step=link / steps if steps else 0.0,
                steps=steps)


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line.split(" ")[0]:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def plot(inproc: dict, remote: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    labels = ["one process", "split services"]
    axes[0].bar(labels, [inproc["tps"], remote["tps"]], color=["#4c72b0", "#dd8452"])
    axes[0].set_ylabel("tokens/s")
    axes[0].set_title("throughput")
    axes[1].bar(labels, [inproc["tau"], remote["tau"]], color=["#4c72b0", "#dd8452"])
    axes[1].set_ylabel("tau (tokens per verified block)")
    axes[1].set_title("acceptance length")
    overhead = 100 * (1 - remote["tps"] / inproc["tps"])
    fig.suptitle(f"split overhead {overhead:.1f}%; drafter link {remote['bytes_per_step'] / 1024:.1f} KiB/step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "split_overhead.png"))
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from dspark.drafters.shipped import default_drafter_dir

    checkpoint = str(default_drafter_dir(args.model) or "")
    messages = [[{"role": "user", "content": f"Write one sentence about {TOPICS[i % len(TOPICS)]}."}]
                for i in range(args.prompts)]
    inproc = in_process(args.model, checkpoint, messages, args.max_tokens)
    remote = split(args.model, checkpoint, messages, args.max_tokens, Path(tempfile.mkdtemp(prefix="split-bench-")))
    same = inproc["outputs"] == remote["outputs"]
    overhead = 100 * (1 - remote["tps"] / inproc["tps"])
    drafter = f"{inproc['kind']} {inproc['version']}" + ("" if checkpoint else " (random init)")
    print(f"\n{args.model}, drafter {drafter}, {args.prompts} prompts x {args.max_tokens} tokens, greedy, "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    print(f"{'':16} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'tau':>6}")
    for name, r in (("one process", inproc), ("split services", remote)):
        print(f"{name:16} {r['tokens']:>7} {r['seconds']:>8.2f} {r['tps']:>9.2f} {r['tau']:>6.2f}")
    print(f"split overhead: {overhead:.1f}% fewer tokens/s than one process")
    print(f"drafter link: {remote['bytes_per_step']:.0f} bytes/step on average over {remote['steps']:.0f} steps "
          f"(both directions)")
    print(f"identical greedy outputs: {same}")
    plot(inproc, remote, Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
