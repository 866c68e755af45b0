"""Real service processes on localhost for the tests: ports, tiny checkpoints, start/kill, health waits."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dspark.local import free_port  # noqa: F401  (the tests' ports: never one handed out twice)

REPO = Path(__file__).resolve().parent.parent
# Every service the tests start authenticates its internal plane with this token (as the chart
# does with its Secret); tests that call an internal service directly send AUTH.
TOKEN = "test-internal-token"
AUTH = (("dspark-internal-token", TOKEN),)
_internal: dict[str, str] = {}  # scheduler public address -> its internal (Scheduler service) address


def internal_address(scheduler: str) -> str:
    """Where verifiers register with the scheduler started at `scheduler` (its public address)."""
    return _internal.get(scheduler, scheduler)


def internal_channel(address: str) -> grpc.Channel:
    """A plaintext channel that sends the test token on every call."""
    from dspark.serving.token_metadata import with_token

    return with_token(grpc.insecure_channel(address), [TOKEN])


TINY_DRAFTER_VERSION = "tiny-trained"


def write_tiny_target(path: Path, seed: int = 0) -> Path:
    """A tiny random Llama as a Hugging Face directory the services load with --model."""
    import torch
    from conftest import tiny_hf_model, write_tiny_tokenizer

    torch.manual_seed(seed)
    model = tiny_hf_model("llama", num_hidden_layers=4, eos_token_id=None)  # no EOS: runs to max_tokens
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # sharper logits: greedy ties are then practically impossible
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    write_tiny_tokenizer(path, model.config.vocab_size)
    return path


def tiny_target_and_reference(tmp_path_factory, prompts, max_tokens: int) -> tuple[str, list[list[int]]]:
    """A tiny target on disk and its greedy outputs in process, at the serving precision: what the
    services must reproduce token for token."""
    from spec_helpers import greedy_reference

    from dspark.models.loader import load_model

    path = write_tiny_target(tmp_path_factory.mktemp("tiny") / "tiny")
    model = load_model(str(path), precision="auto").model
    return str(path), greedy_reference(model, prompts, max_tokens, max_len=1024)


def train_tiny_drafter(target: str, out: Path, gamma: int = 4) -> str:
    """A one-layer DSpark drafter for the tiny target, trained for a few seconds on the target's own
    continuations (~0.86 of its draft tokens accepted in training): drafting pays for it, so a
    budget above 0 is the two-step rule's steady answer, not a passing overpromise of uncalibrated
    confidences. Returns the checkpoint directory (version TINY_DRAFTER_VERSION)."""
    from dspark.train import prepare
    from dspark.train.trainer import train

    prepare.main(["--model", target, "--out", str(out / "data"), "--num-prompts", "64", "--max-new-tokens", "128",
                  "--batch", "16", "--shard-size", "64", "--num-ctx-layers", "2"])
    cfg = {"target": target, "drafter": {"kind": "dspark", "num_layers": 1, "gamma": gamma,
                                         "version": TINY_DRAFTER_VERSION},
           "train": {"steps": 300, "batch_sequences": 8, "max_block_tokens": 256, "save_every": 100000,
                     "warmup_steps": 10}}
    return train(cfg, out / "data", out / "run", show_progress=False)["drafter_dir"]


class Service:
    """One `python -m <module> ...` subprocess, logging to a file next to the test's tmp dir."""

    def __init__(self, module: str, args: list[str], log_dir: Path, name: str | None = None, env: dict | None = None):
        self.module, self.args = module, args
        self.name = name or module
        self.log_path = log_dir / f"{self.name}-{int(time.time() * 1000) % 10**8}.log"
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "DSPARK_INTERNAL_TOKEN": os.environ.get("DSPARK_INTERNAL_TOKEN", TOKEN), **(env or {})}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=full_env,
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def health_status(address: str, timeout: float = 1.0):
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status
        except grpc.RpcError:
            return None


def wait_serving(address: str, service: Service | None = None, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if health_status(address) == health_pb2.HealthCheckResponse.SERVING:
            return
        if service is not None and service.proc.poll() is not None:
            raise RuntimeError(f"{service.name} exited with {service.proc.returncode}:\n{service.log()[-4000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"{address} not serving after {timeout} s" + (f":\n{service.log()[-4000:]}" if service else ""))


def wait_until(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached within {timeout} s")


def scrape(port: int) -> dict[str, float]:
    """A service's Prometheus metrics: sample (with labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines)
            if name and not name.startswith("#")}


def start_drafter(target: str, log_dir: Path, port: int | None = None, **flags) -> tuple[Service, str]:
    port = port or free_port()
    args = [f"--port={port}", f"--target-model={target}", "--gamma=4", "--num-layers=1", "--grace-s=2"]
    args += [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    return Service("drafter_svc", args, log_dir, f"drafter-{port}"), f"127.0.0.1:{port}"


def start_verifier(target: str, log_dir: Path, drafter_addr: str, scheduler: str = "", port: int | None = None,
                   env: dict | None = None, **flags) -> tuple[Service, str]:
    """env: extra environment (tests run every service on one thread; a benchmark may want more)."""
    port = port or free_port()
    scheduler = ",".join(internal_address(s) for s in scheduler.split(",") if s)
    args = [f"--port={port}", f"--model={target}", f"--drafter-addr={drafter_addr}", f"--scheduler-addr={scheduler}",
            f"--verifier-id=verifier-{port}", "--max-batch=16", "--max-len=1024", "--grace-s=5",
            "--drafter-timeout-s=1"]
    args += [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    return Service("verifier_svc", args, log_dir, f"verifier-{port}", env=env), f"127.0.0.1:{port}"


def start_scheduler(log_dir: Path, verifiers: list[str], redis_url: str = "", port: int | None = None,
                    internal_port: int | None = None, **flags) -> tuple[Service, str]:
    """Returns the public address; internal_address() of it is where verifiers register."""
    port, internal_port = port or free_port(), internal_port or free_port()
    args = [f"--port={port}", f"--internal-port={internal_port}", f"--redis-url={redis_url}",
            f"--verifiers={','.join(verifiers)}", "--grace-s=5"]
    args += [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    _internal[f"127.0.0.1:{port}"] = f"127.0.0.1:{internal_port}"
    return Service("scheduler_svc", args, log_dir, f"scheduler-{port}"), f"127.0.0.1:{port}"


def wait_registered(scheduler: str, count: int, timeout: float = 60) -> None:
    """Until the scheduler routes to `count` verifiers (ListModels lists models of live ones only)."""
    from dspark.proto_gen.v1 import (
        generation_pb2,
        generation_pb2_grpc,
        verifier_pb2_grpc,  # noqa: F401  (registers descriptors)
    )

    def live() -> bool:
        with grpc.insecure_channel(scheduler) as channel:
            try:
                models = generation_pb2_grpc.GenerationStub(channel).ListModels(
                    generation_pb2.ListModelsRequest(), timeout=1).models
            except grpc.RpcError:
                return False
        return len(models) > 0

    wait_until(live, timeout, what=f"verifiers registered with {scheduler}")


class RedisServer:
    """A redis-server of the test's own, on its own port (so it can be killed and restarted)."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        wait_until(lambda: self._ping(redis), 10, what="redis-server up")
        return self

    def _ping(self, redis) -> bool:
        try:
            return redis.Redis(port=self.port, socket_timeout=0.2).ping()
        except redis.RedisError:
            return False

    def client(self):
        import redis

        return redis.Redis(port=self.port, socket_timeout=1, decode_responses=True)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class StreamThread:
    """One generate_stream call consumed in a thread, so a test can act while tokens flow."""

    def __init__(self, address: str, retry=None, **request):
        """address: a scheduler (public), or a verifier (the token goes along); several
        comma-separated scheduler replicas with a `retry` policy resume a broken stream."""
        import threading

        from dspark_client import RetryPolicy

        self.address, self.request = address, request
        self.retry = retry or RetryPolicy(max_attempts=1)
        self.chunks, self.error = [], None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from dspark_client import Client

        try:
            with Client(self.address, timeout=300, retry=self.retry, metadata=AUTH) as client:
                for chunk in client.generate_stream(**self.request):
                    self.chunks.append(chunk)
        except Exception as error:  # reported by result()
            self.error = error

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    def result(self, timeout: float = 300):
        from dspark_client.types import collect

        self.thread.join(timeout)
        assert not self.thread.is_alive(), "stream did not finish"
        if self.error is not None:
            raise self.error
        return collect(self.chunks)


def start_gateway(scheduler: str, log_dir: Path, port: int | None = None, api_keys: list[str] = (),
                  **flags) -> tuple[Service, str]:
    """The HTTP gateway; returns its base URL (http://127.0.0.1:PORT)."""
    port = port or free_port()
    args = [f"--port={port}", "--host=127.0.0.1", f"--scheduler-addr={scheduler}", *[f"--api-key={k}" for k in api_keys]]
    args += [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    return Service("gateway_svc", args, log_dir, f"gateway-{port}"), f"http://127.0.0.1:{port}"


def wait_http_ok(url: str, service: Service | None = None, timeout: float = 60) -> None:
    """Until GET url answers 200 (the gateway's /health: the scheduler routes to a verifier)."""
    import urllib.error

    def ok() -> bool:
        if service is not None and service.proc.poll() is not None:
            raise RuntimeError(f"{service.name} exited with {service.proc.returncode}:\n{service.log()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    wait_until(ok, timeout, interval=0.2, what=f"{url} answering 200")
