"""The HTTP gateway under load: N concurrent streaming requests through the gateway (openai client,
SSE) vs the same load through the gRPC SDK straight to the scheduler, in alternating rounds.

    python benchmarks/gateway_load.py [--concurrency 32] [--max-tokens 24] [--rounds 3]
                                      [--scheduler HOST:PORT --gateway URL]

Without --scheduler/--gateway it starts drafter, verifier (--max-batch = concurrency), scheduler
and gateway on localhost with the default target and shipped drafter (as dspark.local does).
Greedy chat requests, one per client, all sent at once; tokens/s = completion tokens of the round
/ its wall time (first request sent -> last stream closed). Each path's best round is kept: on a
shared CPU the worst rounds measure the neighbours. Prints the table; the gateway's ratio to the
SDK is the check (>= 0.95).
"""
from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TOPICS = ["the moon", "rivers", "bread", "chess", "volcanoes", "owls", "the ocean", "trains"]


def prompt(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write one sentence about {TOPICS[i % len(TOPICS)]} (#{i})."}]


async def sdk_round(address: str, n: int, max_tokens: int) -> tuple[int, int, float]:
    from dspark_client import AsyncClient, RetryPolicy

    async with AsyncClient(address, timeout=600, retry=RetryPolicy(max_attempts=1)) as client:
        async def one(i: int) -> int:
            tokens = 0
            async for chunk in client.generate_stream(messages=prompt(i), max_tokens=max_tokens, temperature=0):
                tokens += len(chunk.token_ids)
            return tokens

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    return summarize(results, time.perf_counter() - start)


async def gateway_round(url: str, n: int, max_tokens: int) -> tuple[int, int, float]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        async def one(i: int) -> int:
            stream = await client.chat.completions.create(
                model="", messages=prompt(i), max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True})
            usage = None
            async for event in stream:
                usage = event.usage or usage
            return usage.completion_tokens

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    return summarize(results, time.perf_counter() - start)


def summarize(results, seconds: float) -> tuple[int, int, float]:
    errors = [r for r in results if isinstance(r, BaseException)]
    for error in errors[:3]:
        print(f"  error: {type(error).__name__}: {error}", file=sys.stderr)
    return sum(r for r in results if not isinstance(r, BaseException)), len(errors), seconds


def start_services(concurrency: int, log_dir: Path):
    from dspark.drafters.shipped import default_drafter_dir
    from dspark.local import free_port, start, wait_all
    from dspark.models.loader import DEFAULT_MODEL

    ports = {name: free_port() for name in ("drafter_svc", "verifier_svc", "scheduler_svc", "scheduler_internal",
                                            "gateway_svc")}
    addr = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    token = secrets.token_urlsafe(24)  # the internal plane's shared secret, as dspark.local makes one
    procs = {
        "drafter_svc": start("drafter_svc", [f"--port={ports['drafter_svc']}", f"--max-batch={concurrency}",
                                             f"--checkpoint={default_drafter_dir(DEFAULT_MODEL) or ''}"], log_dir, token),
        "scheduler_svc": start("scheduler_svc", [f"--port={ports['scheduler_svc']}", "--redis-url=",
                                                 f"--internal-port={ports['scheduler_internal']}",
                                                 f"--verifiers={addr['verifier_svc']}"], log_dir, token),
        "verifier_svc": start("verifier_svc", [f"--port={ports['verifier_svc']}", f"--drafter-addr={addr['drafter_svc']}",
                                               f"--scheduler-addr={addr['scheduler_internal']}",
                                               f"--max-batch={concurrency}"], log_dir, token),
    }
    wait_all({n: (p, addr[n]) for n, p in procs.items()}, timeout=600, log_dir=log_dir)
    procs["gateway_svc"] = start("gateway_svc", [f"--port={ports['gateway_svc']}", "--host=127.0.0.1",
                                                 f"--scheduler-addr={addr['scheduler_svc']}"], log_dir)
    url = f"http://127.0.0.1:{ports['gateway_svc']}"
    wait_http(url + "/health", 120)
    return procs, addr["scheduler_svc"], url


def wait_http(url: str, timeout: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} not ready after {timeout:.0f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per path, alternating")
    ap.add_argument("--scheduler", default="", help="use running services: the scheduler's host:port ...")
    ap.add_argument("--gateway", default="", help="... and the gateway's base URL")
    args = ap.parse_args(argv)

    procs = {}
    if args.scheduler and args.gateway:
        scheduler, gateway = args.scheduler, args.gateway.rstrip("/")
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="dspark-gateway-load-"))
        print(f"starting services (logs in {log_dir})", file=sys.stderr)
        procs, scheduler, gateway = start_services(args.concurrency, log_dir)
    paths = {"gRPC SDK": lambda: sdk_round(scheduler, args.concurrency, args.max_tokens),
             "HTTP gateway": lambda: gateway_round(gateway, args.concurrency, args.max_tokens)}
    try:
        for run in paths.values():  # warm-up: first batches, SPS tables, connections
            asyncio.run(run())
        rounds = {name: [] for name in paths}
        for r in range(args.rounds):
            order = list(paths) if r % 2 == 0 else list(reversed(paths))
            for name in order:
                tokens, errors, seconds = asyncio.run(paths[name]())
                rounds[name].append((tokens / seconds, tokens, errors, seconds))
                print(f"  round {r + 1} {name}: {tokens} tokens in {seconds:.2f} s, {errors} errors", file=sys.stderr)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(60)

    best = {name: max(rs) for name, rs in rounds.items()}
    errors = {name: sum(r[2] for r in rs) for name, rs in rounds.items()}
    base = best["gRPC SDK"][0]
    print(f"\n{args.concurrency} concurrent streaming requests, max_tokens={args.max_tokens}, greedy; "
          f"best of {args.rounds} rounds\n")
    print("| path | tokens/s (best) | tokens/s (all rounds) | errors | vs SDK |")
    print("|---|---|---|---|---|")
    for name, (rate, *_rest) in best.items():
        all_rates = ", ".join(f"{r[0]:.1f}" for r in rounds[name])
        print(f"| {name} | {rate:.1f} | {all_rates} | {errors[name]} | {rate / base:.2f}x |")
    ok = errors["HTTP gateway"] == 0 and best["HTTP gateway"][0] >= 0.95 * base
    print(f"\ncheck (0 errors, gateway >= 0.95x SDK): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
