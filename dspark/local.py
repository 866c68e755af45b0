"""Local mode: the three services on localhost with the default models, one prompt through them.

    python -m dspark.local --prompt "What is speculative decoding?"

Starts drafter, verifier and scheduler as subprocesses (the scheduler with its in-process
store: no Redis; on a host of fewer than 8 cores the drafter runs inside the verifier instead of
as its own service, see --drafter-service), waits until they are healthy, streams the answer
through dspark_client, prints tokens/s and the acceptance length tau, then shuts the services
down (SIGTERM).
With --gateway-port=N the OpenAI-compatible HTTP gateway runs too (a fourth process, on
http://127.0.0.1:N/v1) and everything keeps serving after the prompt until Ctrl-C.
The drafter is the shipped checkpoint drafters/<model>/dspark when it exists, else a random
DSpark drafter, so the pipeline runs either way (a random drafter just accepts little).
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dspark.device import add_device_flag, device_or_exit
from dspark.drafters.shipped import default_drafter_dir
from dspark.models.loader import DEFAULT_MODEL
from dspark.models.precision import add_precision_flag
from dspark.models.threads import SMALL_HOST_CORES, available_cores, requested_threads

REPO = Path(__file__).resolve().parent.parent


_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now and never handed out before by this process: services bind theirs later,
    so the kernel may offer again a port that a service still starting is about to take."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def service_threads(cores: int, requested: int | None = None) -> dict[str, int]:
    """Torch threads per local service: the verifier gets OMP_NUM_THREADS (`requested`) or every
    core, the drafter and the rest one. Once the verifier's engine was built on its torch thread
    (no second OpenMP team to throttle its workers' spin), two threads beat one on 2 cores by
    1.55x at c = 1 and 1.42x at c = 16; a drafter on two threads beside it is slower than on one
    (its idle OpenMP workers spin on the verifier's cores: k = 3 through the services 42.0 tokens/s
    against 57.0 on a 2-core host, docs/results.md), so OMP_NUM_THREADS never reaches the others."""
    return {"verifier_svc": max(1, requested or cores)}


def runs_drafter_service(choice: str, cores: int, checkpoint: str) -> bool:
    """Whether the drafter runs as its own service (else inside the verifier): --drafter-service on/off,
    or auto: only where it gets cores of its own. A random drafter (no checkpoint) exists only in the
    drafter service."""
    if not checkpoint:
        return True
    return choice == "on" or (choice == "auto" and cores >= SMALL_HOST_CORES)


def start(module: str, flags: list[str], log_dir: Path, token: str = "") -> subprocess.Popen:
    log = open(log_dir / f"{module}.log", "w")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["OMP_NUM_THREADS"] = str(service_threads(available_cores(), requested_threads()).get(module, 1))
    if token:  # the internal plane's shared secret (a fresh one per run; the gateway needs none)
        env["DSPARK_INTERNAL_TOKEN"] = token
    return subprocess.Popen([sys.executable, "-m", module, *flags], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env=env)


def wait_all(procs: dict[str, tuple[subprocess.Popen, str]], timeout: float, log_dir: Path) -> None:
    deadline = time.monotonic() + timeout
    pending = dict(procs)
    while pending:
        for name, (proc, address) in list(pending.items()):
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited with {proc.returncode}; see {log_dir / (name + '.log')}")
            if serving(address):
                print(f"  {name} ready on {address}", file=sys.stderr)
                del pending[name]
        if time.monotonic() > deadline:
            raise SystemExit(f"not ready after {timeout:.0f} s: {sorted(pending)}; logs in {log_dir}")
        time.sleep(0.3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default="Explain speculative decoding in two sentences.")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--drafter", default="", help="drafter checkpoint directory (default: the shipped one, if any)")
    ap.add_argument("--drafter-service", default="auto", choices=["auto", "on", "off"],
                    help="on: the drafter runs as its own service, as deployed; off: inside the verifier (no round "
                         f"trip); auto: off on a host of fewer than {SMALL_HOST_CORES} cores, where the two would "
                         "share them (2 cores: a drafted step 44 ms through a drafter service against 34 ms inside, "
                         "docs/results.md)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    add_precision_flag(ap)
    add_device_flag(ap)
    ap.add_argument("--gateway-port", type=int, default=0,
                    help="also run the OpenAI-compatible HTTP gateway on this port and serve until Ctrl-C (0 = off)")
    ap.add_argument("--log-dir", default="", help="where the services log (default: a temporary directory)")
    args = ap.parse_args(argv)
    device_or_exit(args.device, "local")  # a missing GPU fails here, before three services start

    import tempfile

    from dspark_client import Client
    from dspark_client.types import collect
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="dspark-local-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = args.drafter or str(default_drafter_dir(args.model) or "")
    split = runs_drafter_service(args.drafter_service, available_cores(), checkpoint)
    ports = {name: free_port() for name in ("drafter_svc", "verifier_svc", "scheduler_svc", "scheduler_internal")}
    token = secrets.token_urlsafe(24)
    addr = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    print(f"starting services (logs in {log_dir}); drafter: {checkpoint or 'random DSpark (no checkpoint found)'}"
          f"{'' if split else ', inside the verifier'}", file=sys.stderr)
    procs = {}
    if split:
        procs["drafter_svc"] = start("drafter_svc", [f"--port={ports['drafter_svc']}", "--kind=dspark",
                                                     f"--checkpoint={checkpoint}", f"--target-model={args.model}",
                                                     f"--precision={args.precision}", f"--device={args.device}"],
                                     log_dir, token)
    procs.update({
        "scheduler_svc": start("scheduler_svc", [f"--port={ports['scheduler_svc']}", "--redis-url=",
                                                 f"--internal-port={ports['scheduler_internal']}",
                                                 f"--verifiers={addr['verifier_svc']}"], log_dir, token),
        "verifier_svc": start("verifier_svc", [f"--port={ports['verifier_svc']}", f"--model={args.model}",
                                               f"--drafter-addr={addr['drafter_svc']}" if split
                                               else f"--drafter={checkpoint}",
                                               f"--scheduler-addr={addr['scheduler_internal']}", "--max-batch=4",
                                               f"--precision={args.precision}", f"--device={args.device}"], log_dir, token),
    })
    try:
        wait_all({n: (p, addr[n]) for n, p in procs.items()}, timeout=600, log_dir=log_dir)
        if args.gateway_port:
            procs["gateway_svc"] = start("gateway_svc", [f"--port={args.gateway_port}", "--host=127.0.0.1",
                                                         f"--scheduler-addr={addr['scheduler_svc']}"], log_dir)
        with Client(addr["scheduler_svc"], timeout=600) as client:
            while not client.list_models():  # the verifier registers with the scheduler right after it is ready
                time.sleep(0.2)
            start_t, chunks = time.perf_counter(), []
            for chunk in client.generate_stream(messages=[{"role": "user", "content": args.prompt}],
                                                max_tokens=args.max_tokens, temperature=args.temperature,
                                                seed=args.seed):
                chunks.append(chunk)
                print(chunk.text, end="", flush=True)
            elapsed = time.perf_counter() - start_t
        result = collect(chunks)
        m = result.metrics
        accepted = f"{m.accepted_tokens}/{m.draft_tokens}" if m else "?"
        tau = (1 + m.accepted_tokens / m.drafts) if m and m.drafts else 1.0
        print(f"\n\n{len(result.token_ids)} tokens in {elapsed:.2f} s = {len(result.token_ids) / elapsed:.1f} tokens/s; "
              f"acceptance length tau = {tau:.2f} ({accepted} draft tokens accepted); "
              f"finish: {result.finish_reason.value if result.finish_reason else '?'}")
        if args.gateway_port:
            print(f"OpenAI-compatible API on http://127.0.0.1:{args.gateway_port}/v1 (Ctrl-C to stop)", file=sys.stderr)
            try:
                procs["gateway_svc"].wait()
            except KeyboardInterrupt:
                pass
        return 0
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    raise SystemExit(main())
