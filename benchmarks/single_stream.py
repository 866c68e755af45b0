"""One request at a time, per eval set: what a single user sees. Plain decoding in this process
(the bar speculation has to clear) and, in the same process, DSpark with prompt lookup and the
shipped datastore at fixed k = 3 and 7 (and k = 3 without the datastore); then through the three
services (drafter, verifier, scheduler as separate processes, gRPC): plain decoding, fixed k = 3 and
7, and the confidence scheduler, with and without draft-ahead, the verifier's prompt lookup and its
datastore; and llama.cpp's plain decoding of the same GGUF, fed the same token ids, in the same run.

    python benchmarks/single_stream.py [--prompts 3] [--max-tokens 128] [--drafter DIR]

Greedy, first turns of datasets/eval; every prompt runs once per configuration, configurations
take turns prompt by prompt (a slow minute of the machine hits all of them alike). tokens/s per
eval set = its tokens / its seconds. Checks that every configuration produced the in-process
greedy text. Writes benchmarks/results/single_stream.{json,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "benchmarks")]
OUT = REPO / "benchmarks" / "results"

SERVICE_CONFIGS = {  # name -> verifier flags (None: no drafter); lookup on unless said
    "services plain": None,
    "services k=3": dict(schedule="off", draft_len=3, draft_ahead="off"),
    "services k=3, draft-ahead": dict(schedule="off", draft_len=3, draft_ahead="on"),
    "services k=7": dict(schedule="off", draft_len=7),  # the whole block: nothing left to guess the next anchor
    "services scheduler": dict(schedule="on", draft_len=3),  # draft-ahead auto (off beside a drafter on few cores)
    "services scheduler, draft-ahead": dict(schedule="on", draft_len=3, draft_ahead="on"),
    "services scheduler, no lookup": dict(schedule="on", draft_len=3, lookup="off"),
    # The same drafter inside the verifier (--drafter): no drafter service, no round trip.
    "services k=3, drafter inside": dict(schedule="off", draft_len=3, drafter="dspark"),
    "services k=7, drafter inside": dict(schedule="off", draft_len=7, drafter="dspark"),
    "services scheduler, drafter inside": dict(schedule="on", draft_len=3, drafter="dspark"),
    "services scheduler, drafter inside, no datastore": dict(schedule="on", draft_len=3, drafter="dspark",
                                                             datastore="off"),
    # The scheduler's own flags ("scheduler" key), for A/B runs of its budget rule: the budget from the
    # newest 4 reports alone (one block each at one request), as before session 32.
    "services scheduler, drafter inside, 4 reports pooled": dict(schedule="on", draft_len=3, drafter="dspark",
                                                                 scheduler=dict(pooled_blocks=0)),
    # Step reports at every look (50 ms), as before session 37 (now: once they hold 16 blocks).
    "services scheduler, drafter inside, reports every look": dict(schedule="on", draft_len=3, drafter="dspark",
                                                                   step_report_blocks=1, step_report_max_s=0.05),
}
# DSpark + prompt lookup + the shipped datastore (or not), this process: name -> (k, datastore)
IN_PROCESS_SPEC = {"in-process k=3": (3, True), "in-process k=7": (7, True), "in-process k=3, no datastore": (3, False)}


def in_process(engine, ids: list[int], max_tokens: int) -> tuple[list[int], float, int]:
    """(greedy tokens, seconds, target passes) on an Engine or a SpecEngine."""
    from dspark.sampling import SamplingParams

    start = time.perf_counter()
    seq = engine.add(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    while engine.has_work():
        engine.step()
    spec = getattr(seq, "spec", None)
    return list(seq.output), time.perf_counter() - start, (spec.metrics.steps + 1) if spec else len(seq.output)


def through_services(address: str, prompt: str, max_tokens: int) -> tuple[list[int], float, int]:
    from concurrency import run_level

    row = run_level(address, 1, [prompt], 1, max_tokens)
    return row["outputs"][0], row["seconds"], round(len(row["outputs"][0]) / row["tau"])


def llamacpp_rate(ids: list[int], max_tokens: int) -> float:
    from engine_speed import llamacpp

    return llamacpp([ids], max_tokens)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default="", help="DSpark checkpoint dir (default: the shipped one)")
    ap.add_argument("--prompts", type=int, default=3, help="per eval set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--datasets", nargs="+", default=None)
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--services", nargs="+", default=list(SERVICE_CONFIGS), choices=list(SERVICE_CONFIGS),
                    help="which services configurations to run")
    ap.add_argument("--out", default=str(OUT / "single_stream"))
    args = ap.parse_args(argv)

    from concurrency import start_stack
    from service_helpers import start_drafter, wait_serving

    from dspark.drafters.lookup import LookupDrafter
    from dspark.drafters.shipped import default_drafter_dir, load_datastore_for, load_drafter_for
    from dspark.engine.generate import Engine
    from dspark.speculative.engine import SpecEngine
    from dspark.speculative.policy import FixedDraftLen
    from dspark.models.loader import load_model
    from dspark.models.threads import available_cores, configure_threads
    from dspark.train.evaluate import DATASETS, load_eval_prompts

    os.environ.setdefault("OMP_NUM_THREADS", str(available_cores()))
    configure_threads()
    datasets = args.datasets or DATASETS
    prompts = {d: load_eval_prompts(d, args.prompts) for d in datasets}
    loaded = load_model(args.model, precision="auto")  # what the verifier serves by default
    ids = {d: [loaded.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in ps] for d, ps in prompts.items()}
    engine = Engine(loaded.model, max_batch=1, max_len=1024)
    in_process(engine, ids[datasets[0]][0], 8)  # first-call allocations, not measured
    inner = load_drafter_for(loaded, args.drafter or "dspark", "auto")
    datastore = load_datastore_for(loaded.name)
    spec_engines = {name: SpecEngine(loaded.model, LookupDrafter(inner, datastore=datastore if ds else None),
                                     FixedDraftLen(k), max_batch=1, max_len=1024)
                    for name, (k, ds) in IN_PROCESS_SPEC.items()}
    llama = not args.skip_llamacpp
    if llama:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama-cpp-python is not installed (pip install -e '.[bench]'): no llama.cpp column")
            llama = False

    checkpoint = args.drafter or str(default_drafter_dir(args.model))
    log_dir = Path(tempfile.mkdtemp(prefix="single-stream-"))
    print(f"{args.model} at {loaded.model.precision}, drafter {checkpoint}, {args.prompts} prompts per set, "
          f"{args.max_tokens} tokens, greedy; service logs in {log_dir}", flush=True)
    args.concurrency = [1]
    drafter, d_addr = start_drafter(args.model, log_dir, checkpoint=checkpoint, gamma=7, num_layers=2, max_batch=4)
    services, stacks = [drafter], {}
    configs = {name: SERVICE_CONFIGS[name] for name in args.services}
    configs = {name: ({**flags, "drafter": checkpoint} if flags and "drafter" in flags else flags)
               for name, flags in configs.items()}
    names = ["in-process plain", *IN_PROCESS_SPEC, *configs] + (["llama.cpp plain"] if llama else [])
    rows = {d: {n: dict(tokens=0, seconds=0.0, steps=0) for n in names} for d in datasets}
    same = True
    try:
        wait_serving(d_addr, drafter, timeout=900)
        for name, flags in configs.items():
            stack, stacks[name] = start_stack(name, flags, d_addr, args, log_dir)
            services += stack
        for address in stacks.values():  # the scheduler learns from some traffic first, unmeasured
            for p in prompts[datasets[0]][:2]:
                through_services(address, p, args.max_tokens // 2)
        for d in datasets:
            for i, prompt in enumerate(prompts[d]):
                reference, seconds, steps = in_process(engine, ids[d][i], args.max_tokens)
                cell = rows[d]["in-process plain"]
                cell["tokens"] += len(reference)
                cell["seconds"] += seconds
                cell["steps"] += steps
                for name, spec_engine in spec_engines.items():
                    out, seconds, steps = in_process(spec_engine, ids[d][i], args.max_tokens)
                    same &= out == reference
                    cell = rows[d][name]
                    cell["tokens"] += len(out)
                    cell["seconds"] += seconds
                    cell["steps"] += steps
                for name, address in stacks.items():
                    out, seconds, steps = through_services(address, prompt, args.max_tokens)
                    same &= out == reference
                    cell = rows[d][name]
                    cell["tokens"] += len(out)
                    cell["seconds"] += seconds
                    cell["steps"] += steps
                if llama:
                    cell = rows[d]["llama.cpp plain"]
                    cell["tokens"] += args.max_tokens
                    cell["seconds"] += args.max_tokens / llamacpp_rate(ids[d][i], args.max_tokens)
                    cell["steps"] += args.max_tokens
            line = "  ".join(f"{n} {r['tokens'] / r['seconds']:.1f}" for n, r in rows[d].items())
            print(f"  {d}: {line}", flush=True)
    finally:
        for service in reversed(services):
            service.terminate(30)

    tps = {d: {n: r["tokens"] / r["seconds"] for n, r in rows[d].items()} for d in datasets}
    tau = {d: {n: r["tokens"] / max(1, r["steps"]) for n, r in rows[d].items()} for d in datasets}
    print(f"\ntokens/s, one request at a time (tokens per target pass in brackets), "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    print("| eval set | " + " | ".join(names) + " | best in-process / plain | best services / in-process plain |")
    print("|---" * (len(names) + 3) + "|")
    for d in datasets + ["mean"]:
        if d == "mean":
            t = {n: sum(tps[x][n] for x in datasets) / len(datasets) for n in names}
            k = {n: sum(tau[x][n] for x in datasets) / len(datasets) for n in names}
        else:
            t, k = tps[d], tau[d]
        best = max(configs, key=lambda n: t[n])
        best_local = max(IN_PROCESS_SPEC, key=lambda n: t[n])
        print(f"| {d} | " + " | ".join(f"{t[n]:.1f} ({k[n]:.2f})" for n in names)
              + f" | {t[best_local] / t['in-process plain']:.2f}x ({best_local})"
              + f" | {t[best] / t['in-process plain']:.2f}x ({best}) |")
    print(f"every configuration gave the in-process greedy text: {same}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(model=args.model, drafter=checkpoint, prompts=args.prompts,
                                                        max_tokens=args.max_tokens, same_text=same,
                                                        tokens_per_s=tps, tokens_per_pass=tau), indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plotting import grouped_bars, save_figure

    fig, ax = plt.subplots(figsize=(12, 4))  # room for the legend beside the bars
    grouped_bars(ax, datasets, {n: [tps[d][n] for d in datasets] for n in names})
    ax.set_ylabel("tokens/s, one request")
    ax.set_title(f"{args.model}: single stream per eval set ({args.max_tokens} tokens, greedy)")
    save_figure(fig, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
