"""What the serving path costs: plain decoding (no drafter) through the scheduler and verifier
services against the same engine in this process, same model, precision, prompts and greedy
text, in one run (issue 13: >= 0.9x in-process at c = 1, >= 0.95x at c = 16).

    python benchmarks/serving_path.py [--concurrency 1 16] [--max-tokens 64] [--rounds 3]

A round at concurrency c: c requests at once (c clients, the SDK's AsyncClient, through the
services; c sequences in one continuous batch in process), tokens/s = tokens / wall time. The services are measured
twice: clients reading a chunk every engine step (stream_interval_ms 0, what a streaming UI asks
for) and the SDK's generate() (the whole answer; its stream is chunked at most every 500 ms).
Rounds rotate which side goes first; the median round counts, and so does the median of the
services / in-process ratio within each round (steadier on a host whose speed drifts). Also
prints the verifier's own engine time per step (its Prometheus histogram), so the gap splits into
engine work and everything around it, and the CPU each hop spends a token (/proc times: the
verifier's event loop thread, the scheduler process, this process: the clients' event loop).
Writes benchmarks/results/serving_path.{json,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import concurrency

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
OUT = REPO / "benchmarks" / "results"


def in_process_round(engine, prompt_ids: list[list[int]], max_tokens: int) -> dict:
    from dspark.sampling import SamplingParams

    start = time.perf_counter()
    seqs = [engine.add(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)) for ids in prompt_ids]
    while engine.has_work():
        engine.step()
    elapsed = time.perf_counter() - start
    outputs = [list(s.output) for s in seqs]
    return dict(tps=sum(map(len, outputs)) / elapsed, outputs=outputs)


def services_round(address: str, prompts: list[str], max_tokens: int, stream_interval_ms: int | None,
                   users: concurrency.Users | None = None) -> dict:
    from concurrency import run_level

    row = run_level(address, len(prompts), prompts, 1, max_tokens, stream_interval_ms=stream_interval_ms,
                    users=users)
    return dict(tps=row["total_tps"], outputs=[row["outputs"][i] for i in range(len(prompts))])


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User + system CPU time of a process (all its threads), or of one of its threads."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# The services' sides: how the client reads its stream (generation.proto's stream_interval_ms).
STREAM_MODES = {"services, a chunk every step": 0, "services, generate()": None}


def engine_seconds(metrics_url: str) -> tuple[float, float]:
    """(sum, count) of the verifier's engine step histogram."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    total = count = 0.0
    for name, value in re.findall(r"^dspark_step_latency_seconds_(sum|count)\S* ([0-9.e+-]+)$", text, re.M):
        if name == "sum":
            total += float(value)
        else:
            count += float(value)
    return total, count


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(OUT / "serving_path"))
    args = ap.parse_args(argv)

    from concurrency import Users, eval_prompts
    from service_helpers import free_port, start_scheduler, start_verifier, wait_registered, wait_serving

    import torch

    from dspark.engine.generate import Engine
    from dspark.models.loader import load_model
    from dspark.models.threads import configure_threads

    configure_threads()
    prompts = eval_prompts(max(args.concurrency), REPO / "datasets" / "eval")
    loaded = load_model(args.model, precision="auto")  # what the verifier serves by default
    ids = [loaded.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    engine = Engine(loaded.model, max_batch=max(args.concurrency), max_len=1024)

    log_dir = Path(tempfile.mkdtemp(prefix="serving_path_"))
    metrics_port = free_port()
    scheduler, s_addr = start_scheduler(log_dir, [])
    # The verifier gets the threads this process's engine has (test helpers default to one).
    verifier, v_addr = start_verifier(args.model, log_dir, "", s_addr, max_batch=max(args.concurrency), max_len=1024,
                                      metrics_port=metrics_port, env={"OMP_NUM_THREADS": str(torch.get_num_threads())})
    results = {}
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        for service, address in ((verifier, v_addr), (scheduler, s_addr)):
            wait_serving(address, service, timeout=900)
        wait_registered(s_addr, 1)
        services_round(s_addr, prompts[:2], 8, None)  # first-call allocations, not measured
        in_process_round(engine, ids[:2], 8)
        sides = ["in-process", *STREAM_MODES]
        hops = {"verifier event loop": lambda: cpu_seconds(verifier.proc.pid, verifier.proc.pid),
                "scheduler": lambda: cpu_seconds(scheduler.proc.pid),
                "client": lambda: cpu_seconds(os.getpid())}
        for c in args.concurrency:
            users = Users(s_addr, c)  # long-lived, as users': no handshakes in the rounds
            rounds = {side: [] for side in sides}
            for r in range(args.rounds):
                for side in sides[r % len(sides):] + sides[:r % len(sides)]:  # each side first in turn
                    if side in STREAM_MODES:
                        before, cpu_before = engine_seconds(metrics_url), {h: f() for h, f in hops.items()}
                        row = services_round(s_addr, prompts[:c], args.max_tokens, STREAM_MODES[side], users)
                        after = engine_seconds(metrics_url)
                        tokens = sum(map(len, row["outputs"]))
                        row["cpu_ms_per_token"] = {h: 1e3 * (f() - cpu_before[h]) / tokens for h, f in hops.items()}
                        row["engine_step_ms"] = 1e3 * (after[0] - before[0]) / max(1.0, after[1] - before[1])
                        row["engine_steps"] = int(after[1] - before[1])
                    else:
                        started = time.perf_counter()
                        row = in_process_round(engine, ids[:c], args.max_tokens)
                        row["engine_steps"] = max(map(len, row["outputs"]))  # one token a step, all at once
                        row["engine_step_ms"] = 1e3 * (time.perf_counter() - started) / row["engine_steps"]
                    rounds[side].append(row)
                    print(f"c={c:<3} round {r + 1}/{args.rounds} {side:30} {row['tps']:7.2f} tokens/s  "
                          f"engine {row['engine_steps']} steps, {row['engine_step_ms']:.1f} ms/step", flush=True)
            users.close()
            reference = rounds["in-process"][0]["outputs"]
            median = {side: statistics.median(r["tps"] for r in rows) for side, rows in rounds.items()}
            step_ms = {side: statistics.median(r["engine_step_ms"] for r in rows) for side, rows in rounds.items()}
            modes = {}
            for side in STREAM_MODES:
                # This host's speed drifts by +-25% within minutes: the ratio of the two sides measured in
                # the same round is steadier than the ratio of two medians taken apart.
                pairs = [s["tps"] / i["tps"] for i, s in zip(rounds["in-process"], rounds[side])]
                cpu = {h: statistics.median(r["cpu_ms_per_token"][h] for r in rounds[side]) for h in hops}
                modes[side] = dict(tps=median[side], ratio=median[side] / median["in-process"],
                                   pair_ratio=statistics.median(pairs), pair_range=[min(pairs), max(pairs)],
                                   same_text=all(r["outputs"] == reference for r in rounds[side]),
                                   cpu_ms_per_token=cpu, step_ms=step_ms[side], rounds=[r["tps"] for r in rounds[side]])
            results[c] = dict(in_process=median["in-process"], step_ms=step_ms["in-process"],
                              rounds=[r["tps"] for r in rounds["in-process"]], services=modes)
    finally:
        for service in (verifier, scheduler):
            service.terminate(30)

    hop_names = list(hops)
    print("\n| concurrency | side | tokens/s | / in-process | per round: median (range) | same greedy text | "
          + " | ".join(f"CPU ms a token: {h}" for h in hop_names) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(hop_names))
    for c, row in results.items():
        print(f"| {c} | in-process | {row['in_process']:.1f} | 1.00x | | True |" + " |" * len(hop_names))
        for side, mode in row["services"].items():
            low, high = mode["pair_range"]
            print(f"| {c} | {side} | {mode['tps']:.1f} | {mode['ratio']:.2f}x | {mode['pair_ratio']:.2f}x "
                  f"({low:.2f}-{high:.2f}) | {mode['same_text']} | "
                  + " | ".join(f"{mode['cpu_ms_per_token'][h]:.3f}" for h in hop_names) + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(max_tokens=args.max_tokens, results=results), indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plotting import grouped_bars, save_figure

    fig, (rate, cpu) = plt.subplots(1, 2, figsize=(11, 4))
    series = {"in-process": [r["in_process"] for r in results.values()]}
    for side in STREAM_MODES:
        series[side] = [r["services"][side]["tps"] for r in results.values()]
    grouped_bars(rate, [f"c = {c}" for c in results], series)
    rate.set_ylabel("tokens/s"), rate.set_title("plain decoding: through the services vs in process")
    grouped_bars(cpu, [f"c = {c}\n{side.removeprefix('services, ')}" for c in results for side in STREAM_MODES],
                 {h: [r["services"][side]["cpu_ms_per_token"][h] for r in results.values() for side in STREAM_MODES]
                  for h in hop_names})
    cpu.set_ylabel("ms of CPU a token"), cpu.set_title("what each hop costs")
    save_figure(fig, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
