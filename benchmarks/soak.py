"""Soak: N concurrent streams for a long time through the three services, the drafter at work on
every step; errors counted, each service's resident memory sampled.

    python benchmarks/soak.py [--streams 16] [--minutes 10] [--warmup-minutes 2] [--model NAME]

Starts a Redis of its own, drafter (the shipped checkpoint), verifier (--max-batch = streams,
a draft every step and the whole block verified, so the drafter works all the time) and
scheduler (on that Redis), with the internal token, as the chart runs them. Each of the N
workers sends request after request: chat prompts of varied length, max_tokens 8-96, greedy or
seeded sampling, one in eight abandoned after its first tokens (the cancel path frees the slot
and the drafter's context). RSS of each process from /proc every 10 s.

Growth = RSS at the end (median of the last 3 samples) over RSS at the end of the warm-up
(median of 3 samples there), minus 1. The check: 0 errors and growth < 5% for every service.
Prints a table, writes benchmarks/results/soak.json and soak.png.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
RESULTS = REPO / "benchmarks" / "results"
TOPICS = ["the moon", "rivers", "bread", "chess", "volcanoes", "owls", "the ocean", "trains", "glaciers",
          "libraries", "bees", "lighthouses"]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Worker(threading.Thread):
    """Request after request on one connection until `stop`; counts tokens, requests, errors."""

    def __init__(self, index: int, address: str, stop: threading.Event):
        super().__init__(daemon=True, name=f"soak-{index}")
        self.index, self.address, self.stop = index, address, stop
        self.rng = random.Random(index)
        self.requests = self.tokens = self.abandoned = 0
        self.errors: list[str] = []

    def run(self) -> None:
        from dspark_client import Client, RetryPolicy

        with Client(self.address, timeout=600, retry=RetryPolicy(max_attempts=1)) as client:
            while not self.stop.is_set():
                rng = self.rng
                topic = rng.choice(TOPICS)
                words = " ".join(rng.choice(TOPICS) for _ in range(rng.randint(0, 40)))
                content = f"Write about {topic}. {words}".strip()
                sampling = dict(temperature=0.0) if rng.random() < 0.5 else dict(
                    temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 30))
                abandon = rng.random() < 0.125
                try:
                    for n, chunk in enumerate(client.generate_stream(
                            messages=[{"role": "user", "content": content}], max_tokens=rng.randint(8, 96),
                            **sampling)):
                        self.tokens += len(chunk.token_ids)
                        if abandon and n >= 2:
                            self.abandoned += 1
                            break  # the SDK cancels the call: the server frees the slot
                    self.requests += 1
                except Exception as error:  # counted and reported; the soak goes on
                    self.errors.append(f"{type(error).__name__}: {error}"[:300])


def start_services(args, log_dir: Path):
    from service_helpers import (
        RedisServer,
        start_drafter,
        start_scheduler,
        start_verifier,
        wait_registered,
        wait_serving,
    )

    from dspark.drafters.shipped import default_drafter_dir

    redis_server = RedisServer().start()
    checkpoint = str(default_drafter_dir(args.model) or "")
    drafter, d_addr = start_drafter(args.model, log_dir, checkpoint=checkpoint, max_batch=args.streams)
    scheduler, s_addr = start_scheduler(log_dir, [], redis_url=redis_server.url)
    verifier, v_addr = start_verifier(args.model, log_dir, d_addr, s_addr, max_batch=args.streams, max_len=2048,
                                      explore=1.0, draft_probe_every=1, drafter_timeout_s=30)
    services = {"drafter": drafter, "verifier": verifier, "scheduler": scheduler}
    for service, address in ((drafter, d_addr), (scheduler, s_addr), (verifier, v_addr)):
        wait_serving(address, service, timeout=900)
    wait_registered(s_addr, 1, timeout=120)
    return services, s_addr, redis_server


def plot(samples: dict, warmup_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, points in samples.items():
        ax.plot([t / 60 for t, _ in points], [m for _, m in points], label=name, linewidth=1.6)
    ax.axvspan(0, warmup_s / 60, color="0.9", label="warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_yscale("log")
    ax.set_title("Soak: resident memory per service")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def around(points: list[tuple[float, float]], t: float, n: int = 3) -> float:
    """Median RSS of the n samples closest to time t."""
    nearest = sorted(points, key=lambda p: abs(p[0] - t))[:n]
    return statistics.median(m for _, m in nearest)


def main(argv=None) -> int:
    from dspark.models.loader import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--warmup-minutes", type=float, default=2)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--sample-s", type=float, default=10)
    args = ap.parse_args(argv)

    log_dir = Path(tempfile.mkdtemp(prefix="dspark-soak-"))
    print(f"starting services (logs in {log_dir})", file=sys.stderr)
    services, scheduler, redis_server = start_services(args, log_dir)
    stop = threading.Event()
    workers = [Worker(i, scheduler, stop) for i in range(args.streams)]
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in services}
    duration, warmup = args.minutes * 60, args.warmup_minutes * 60
    try:
        started = time.monotonic()
        for worker in workers:
            worker.start()
        while (elapsed := time.monotonic() - started) < duration:
            for name, service in services.items():
                samples[name].append((elapsed, rss_mib(service.proc.pid)))
            tokens = sum(w.tokens for w in workers)
            print(f"  {elapsed / 60:5.1f} min: {sum(w.requests for w in workers)} requests, {tokens} tokens, "
                  f"{sum(len(w.errors) for w in workers)} errors; RSS "
                  + ", ".join(f"{n} {s[-1][1]:.0f}" for n, s in samples.items()), file=sys.stderr)
            time.sleep(args.sample_s)
        elapsed = time.monotonic() - started
        for name, service in services.items():
            samples[name].append((elapsed, rss_mib(service.proc.pid)))
        stop.set()
        for worker in workers:
            worker.join(300)  # each finishes the request it is in
        alive = {name: service.proc.poll() is None for name, service in services.items()}
    finally:
        stop.set()
        for service in services.values():
            service.terminate(30)
        redis_server.kill()

    errors = [e for w in workers for e in w.errors]
    requests, tokens = sum(w.requests for w in workers), sum(w.tokens for w in workers)
    rows = {}
    for name, points in samples.items():
        base, end = around(points, warmup), around(points, points[-1][0])
        rows[name] = dict(start_mib=points[0][1], warm_mib=base, end_mib=end, peak_mib=max(m for _, m in points),
                          growth=end / base - 1, alive=alive[name])
    print(f"\n{args.streams} streams x {elapsed / 60:.1f} min ({args.model}, drafter every step): {requests} requests, "
          f"{tokens} tokens ({tokens / elapsed:.1f} tokens/s), {sum(w.abandoned for w in workers)} abandoned "
          f"mid-stream, {len(errors)} errors\n")
    print("| service | RSS at start (MiB) | after warm-up (MiB) | at end (MiB) | peak (MiB) | growth after warm-up |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['start_mib']:.0f} | {r['warm_mib']:.0f} | {r['end_mib']:.0f} | {r['peak_mib']:.0f} | "
              f"{100 * r['growth']:+.1f}% |")
    for error in errors[:5]:
        print(f"  error: {error}", file=sys.stderr)
    ok = not errors and all(r["growth"] < 0.05 and r["alive"] for r in rows.values())
    print(f"\ncheck (0 errors, every service alive, RSS growth < 5% after warm-up): {'PASS' if ok else 'FAIL'}")

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps(dict(
        streams=args.streams, minutes=elapsed / 60, warmup_minutes=args.warmup_minutes, model=args.model,
        requests=requests, tokens=tokens, errors=len(errors), services=rows,
        samples={n: [[round(t, 1), round(m, 1)] for t, m in s] for n, s in samples.items()}), indent=1))
    plot(samples, warmup, RESULTS / "soak.png")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
