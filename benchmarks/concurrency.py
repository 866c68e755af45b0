"""Confidence-scheduled verification under load: tokens/s through the three services (drafter,
verifier, scheduler as separate processes, gRPC) at each concurrency, for plain decoding,
fixed k = 1, 3, 7 and the scheduler (two-step rule, method.md 5), with the drafter as its own service
and inside the verifier (--drafter), with and without the verifier's datastore, in one run.

    python benchmarks/concurrency.py [--concurrency 1 2 4 8 16 32] [--max-tokens 128]
                                     [--seconds 6] [--repeats 3] [--drafter DIR]

All configurations run at once, each as its own scheduler + verifier (sharing one drafter
service, or each with the drafter inside), so they are measured side by side. Every stack first
serves some traffic unmeasured (steady state: the online calibration and the live SPS tables have learned); then each
concurrency level warms every stack up at that load (unmeasured), then runs `--repeats` rounds
over the stacks in rotating order and keeps each stack's median round. A round is `c` clients
(coroutines of the SDK's AsyncClient on one event loop), each sending requests one after another
for `--seconds` (closed loop; a request started before the deadline runs to its end), so a level
measures a steady load over many prompts rather than one batch whose slowest request decides
the wall time (`--seconds 0`: one request per client). Each request is the SDK's generate(),
whose stream is chunked at most every 500 ms (stream_interval_ms). Greedy, prompts from
datasets/eval (first turns), each client walking through them from its own offset. The drafter is
the shipped DSpark checkpoint. Prints the table, checks that every configuration produced the same
greedy text (lossless), writes benchmarks/results/concurrency.{json,png}.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
OUT = REPO / "benchmarks" / "results"

# name -> verifier flags (None: no drafter at all)
CONFIGS = {
    "no speculation": None,
    "fixed k=1": dict(schedule="off", draft_len=1),
    "fixed k=3": dict(schedule="off", draft_len=3),
    "fixed k=7": dict(schedule="off", draft_len=7),
    "scheduler": dict(schedule="on", draft_len=3),  # the fallback while the scheduler has not decided
    "scheduler, no lookup": dict(schedule="on", draft_len=3, lookup="off"),  # the drafter's blocks alone
    # The same drafter inside each verifier (--drafter): no drafter service, no round trip.
    "fixed k=3, drafter inside": dict(schedule="off", draft_len=3, drafter="dspark"),
    "fixed k=7, drafter inside": dict(schedule="off", draft_len=7, drafter="dspark"),
    "scheduler, drafter inside": dict(schedule="on", draft_len=3, drafter="dspark"),
    "scheduler, drafter inside, no datastore": dict(schedule="on", draft_len=3, drafter="dspark", datastore="off"),
    "scheduler, drafter inside, no lookup": dict(schedule="on", draft_len=3, drafter="dspark", lookup="off"),
    # The scheduler's own flags ("scheduler" key), for A/B runs of its budget rule.
    "scheduler, drafter inside, 16 reports pooled": dict(schedule="on", draft_len=3, drafter="dspark",
                                                         scheduler=dict(pooled_reports=16)),
    "scheduler, drafter inside, 64 reports pooled": dict(schedule="on", draft_len=3, drafter="dspark",
                                                         scheduler=dict(pooled_reports=64)),
}


def eval_prompts(count: int, eval_dir: Path) -> list[str]:
    from dspark.train.evaluate import DATASETS, load_eval_prompts

    per = -(-count // len(DATASETS))
    pools = [load_eval_prompts(name, per, eval_dir) for name in DATASETS]
    return [pools[i % len(pools)][i // len(pools)] for i in range(count)]


class Users:
    """`count` long-lived SDK clients, as many users' (connected before the clock starts: a level
    measures generation, not `count` TCP + HTTP/2 handshakes). Their calls run as coroutines on one
    event loop in the calling thread (the SDK's AsyncClient), as a load generator holds many
    streams: a client thread each, at 16 requests of 64 tokens, took ~100 ms of CPU a round
    (2.5x this) from the two cores the verifier decodes on, and read 0.90x in-process where this
    reads 0.95x (docs/results.md, session 45)."""

    def __init__(self, address: str, count: int):
        self.loop = asyncio.new_event_loop()
        self.clients = self.run(self._connect(address, count))

    @staticmethod
    async def _connect(address: str, count: int) -> list:
        from dspark_client import AsyncClient, RetryPolicy

        clients = [AsyncClient(address, timeout=1800, retry=RetryPolicy(max_attempts=1)) for _ in range(count)]
        for client in clients:
            await client.list_models()
        return clients

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def close(self) -> None:
        async def close_all():
            await asyncio.gather(*(client.close() for client in self.clients))

        self.run(close_all())
        self.loop.close()


def run_level(address: str, concurrency: int, prompts: list[str], per_client: int, max_tokens: int,
              seconds: float = 0.0, stream_interval_ms: int | None = None, users: Users | None = None,
              first: int = 0) -> dict:
    """c clients, each sending `per_client` requests one after another, or as many as start within
    `seconds` when that is > 0. Request i of client c uses prompt (first + c + i * concurrency) mod |prompts|.
    Each request is the SDK's generate() (its stream chunked by stream_interval_ms, None = generate()'s
    default). `users`: at least c connected clients to use (and leave open), else made and closed here."""
    records, errors = [], []
    owned = users is None
    users = Users(address, concurrency) if owned else users
    interval = {} if stream_interval_ms is None else {"stream_interval_ms": stream_interval_ms}

    async def client_loop(c: int) -> None:
        for i in itertools.count():
            if (time.perf_counter() >= deadline) if seconds > 0 else (i >= per_client):
                return
            index = (first + c + i * concurrency) % len(prompts)
            start = time.perf_counter()
            try:
                result = await users.clients[c].generate(messages=[{"role": "user", "content": prompts[index]}],
                                                         max_tokens=max_tokens, temperature=0.0, **interval)
            except Exception as error:  # reported after the level
                errors.append(error)
                return
            records.append(dict(prompt=index, tokens=list(result.token_ids),
                                seconds=time.perf_counter() - start, steps=result.metrics.steps,
                                draft_tokens=result.metrics.draft_tokens,
                                accepted=result.metrics.accepted_tokens))

    async def all_clients() -> None:
        await asyncio.gather(*(client_loop(c) for c in range(concurrency)))

    try:
        start = time.perf_counter()
        deadline = start + seconds
        users.run(all_clients())
        elapsed = time.perf_counter() - start
    finally:
        if owned:
            users.close()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed at concurrency {concurrency}: {errors[0]}")
    tokens = sum(len(r["tokens"]) for r in records)
    steps = sum(r["steps"] for r in records)
    return dict(concurrency=concurrency, total_tps=tokens / elapsed,
                per_request_tps=statistics.mean(len(r["tokens"]) / r["seconds"] for r in records),
                verified_per_step=sum(r["draft_tokens"] for r in records) / steps,
                tau=(tokens / steps) if steps else 1.0, seconds=elapsed,
                outputs={r["prompt"]: r["tokens"] for r in records})


def start_stack(name: str, flags: dict | None, drafter_addr: str, args, log_dir: Path):
    """One scheduler + one verifier for a configuration (the scheduler routes to that verifier only)."""
    from service_helpers import start_scheduler, start_verifier, wait_registered, wait_serving

    scheduler_flags = (flags or {}).get("scheduler", {})
    flags = flags if flags is None else {k: v for k, v in flags.items() if k != "scheduler"}
    scheduler, s_addr = start_scheduler(log_dir, [], **scheduler_flags)
    from dspark.models.threads import available_cores

    # Every core, as a deployed verifier has (the test helpers default a service to one thread).
    # A configuration with its own `drafter` runs it inside the verifier; the others call the drafter service.
    remote = flags is not None and "drafter" not in flags
    verifier, v_addr = start_verifier(args.model, log_dir, drafter_addr if remote else "", s_addr,
                                      max_batch=max(args.concurrency), max_len=1024, drafter_timeout_s=30,
                                      env={"OMP_NUM_THREADS": str(available_cores())}, **(flags or {}))
    services = [verifier, scheduler]
    try:
        for service, address in ((verifier, v_addr), (scheduler, s_addr)):
            wait_serving(address, service, timeout=900)  # one at a time: the SPS warm-up runs alone
        wait_registered(s_addr, 1)
        run_level(s_addr, 1, ["Hi"], 1, 8)  # first-call allocations, not measured
    except BaseException:
        for service in services:
            service.terminate(30)
        raise
    print(f"  {name}: up", flush=True)
    return services, s_addr


def measure(stacks: dict, args, prompts) -> dict[str, list[dict]]:
    """Per concurrency: an unmeasured warm-up on every stack (the scheduler's K follows the new
    load), then `repeats` rounds over the stacks in rotating order; the median round counts. Each
    round starts at its own place in the prompts (every stack the same), so a verifier does not find a
    prompt it served a round before still held in a KV slot (prefix reuse) more than users' traffic would."""
    results = {name: [] for name in stacks}
    names = list(stacks)
    # A stack's first minutes are not its steady state: the scheduler's online calibration and
    # each verifier's live SPS / draft-cost tables learn from traffic. Serve some first, unmeasured.
    for name in names:
        run_level(stacks[name], args.warmup_concurrency, prompts, args.warmup_requests, args.max_tokens)
    print("  warmed up", flush=True)
    stride = len(prompts) // (len(args.concurrency) * args.repeats + 1)
    for level, c in enumerate(args.concurrency):
        for name in names:
            run_level(stacks[name], c, prompts, 1, args.max_tokens // 3)
        rounds = {name: [] for name in names}
        for r in range(args.repeats):
            first = (1 + level * args.repeats + r) * stride
            for name in names[r % len(names):] + names[:r % len(names)]:
                rounds[name].append(run_level(stacks[name], c, prompts, args.requests_per_client, args.max_tokens,
                                              args.seconds, first=first))
        for name in names:
            row = sorted(rounds[name], key=lambda x: x["total_tps"])[len(rounds[name]) // 2]
            row["spread"] = (min(x["total_tps"] for x in rounds[name]), max(x["total_tps"] for x in rounds[name]))
            results[name].append(row)
            print(f"  {name:15} c={c:<3} {row['total_tps']:7.2f} tok/s total (rounds {row['spread'][0]:.2f}-"
                  f"{row['spread'][1]:.2f}) {row['per_request_tps']:6.2f} per request  drafts/step "
                  f"{row['verified_per_step']:.2f}  tokens/step {row['tau']:.2f}", flush=True)
    return results


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in results.items():
        c = [r["concurrency"] for r in rows]
        style = dict(marker="o", linewidth=2.5 if name == "scheduler" else 1.2)
        axes[0].plot(c, [r["total_tps"] for r in rows], label=name, **style)
        axes[1].plot(c, [r["per_request_tps"] for r in rows], label=name, **style)
    for ax, what in zip(axes, ("total tokens/s", "tokens/s per request")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default="", help="DSpark checkpoint dir (default: the shipped one)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--seconds", type=float, default=6.0,
                    help="a round: each client sends requests back to back for this long (0: one each)")
    ap.add_argument("--requests-per-client", type=int, default=1, help="with --seconds 0")
    ap.add_argument("--prompts", type=int, default=400, help="eval prompts the clients walk through")
    ap.add_argument("--repeats", type=int, default=3, help="measured rounds per configuration and concurrency")
    ap.add_argument("--warmup-concurrency", type=int, default=4)
    ap.add_argument("--warmup-requests", type=int, default=6, help="per client, before any measurement")
    # 128, as the single-stream table: 32 tokens after the eval prompts' ~105 (chat template) made the
    # prompts ~3/4 of the rows a request puts through the target, a benchmark of prefill.
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--out", default=str(OUT / "concurrency"))
    ap.add_argument("--eval-dir", type=Path, default=REPO / "datasets" / "eval", help="folder of <dataset>.jsonl prompts")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from service_helpers import start_drafter, wait_serving

    from dspark.drafters.shipped import default_drafter_dir

    checkpoint = args.drafter or str(default_drafter_dir(args.model))
    prompts = eval_prompts(max(args.prompts, max(args.concurrency) * args.requests_per_client), args.eval_dir)
    log_dir = Path(tempfile.mkdtemp(prefix="concurrency-bench-"))
    per_round = f"{args.seconds:g} s of requests" if args.seconds > 0 else f"{args.requests_per_client} requests"
    print(f"{args.model}, drafter {checkpoint}, {args.max_tokens} tokens per request, greedy, "
          f"{per_round} per client a round; service logs in {log_dir}", flush=True)
    drafter, d_addr = start_drafter(args.model, log_dir, checkpoint=checkpoint, gamma=7, num_layers=2,
                                    max_batch=max(args.concurrency))
    services, stacks = [drafter], {}
    try:
        wait_serving(d_addr, drafter, timeout=900)
        for name in args.configs:
            flags = CONFIGS[name]
            if flags and "drafter" in flags:
                flags = {**flags, "drafter": checkpoint}
            stack, s_addr = start_stack(name, flags, d_addr, args, log_dir)
            services += stack
            stacks[name] = s_addr
        results = measure(stacks, args, prompts)
    finally:
        for service in reversed(services):
            service.terminate(30)

    names = list(results)
    reference = results[names[0]]
    # Rounds of a time budget serve different prompt sets: compare the prompts both served.
    identical = all(row["outputs"][p] == ref["outputs"][p] for name in names
                    for row, ref in zip(results[name], reference) for p in row["outputs"].keys() & ref["outputs"].keys())
    print(f"\ntotal tokens/s (per-request tokens/s), OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    print(f"{'concurrency':>11} " + " ".join(f"{n:>18}" for n in names))
    for i, c in enumerate(args.concurrency):
        cells = [f"{results[n][i]['total_tps']:8.2f} ({results[n][i]['per_request_tps']:5.2f})" for n in names]
        print(f"{c:>11} " + " ".join(f"{cell:>18}" for cell in cells))
    others = [n for n in names if n != "scheduler"]
    if "scheduler" in results and others:
        print("\nscheduler / best other, scheduler / no speculation (total tokens/s):")
        for i, c in enumerate(args.concurrency):
            sched = results["scheduler"][i]["total_tps"]
            best = max(others, key=lambda n: results[n][i]["total_tps"])
            overlap = results["scheduler"][i]["spread"][1] >= results[best][i]["spread"][0]
            line = (f"  c={c:<3} {sched / results[best][i]['total_tps']:.3f} (best other: {best}; "
                    f"rounds overlap: {'yes' if overlap else 'no'})")
            if "no speculation" in results:
                line += f"  {sched / results['no speculation'][i]['total_tps']:.3f}"
            print(line)
    print(f"identical greedy outputs across configurations: {identical}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {n: [{k: v for k, v in row.items() if k != "outputs"} for row in rows] for n, rows in results.items()}
    out.with_suffix(".json").write_text(json.dumps(dict(model=args.model, drafter=checkpoint,
                                                        max_tokens=args.max_tokens, seconds=args.seconds,
                                                        identical_outputs=identical,
                                                        results=summary), indent=1))
    plot(results, out.with_suffix(".png"),
         f"{args.model} + DSpark through the services ({args.max_tokens} tokens/request, greedy)")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
