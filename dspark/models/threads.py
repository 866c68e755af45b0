"""How many CPU threads torch uses: the cores this process is given, said once at start."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)
# Below this many cores a drafter and the target on one machine share them: a drafter working
# beside the target's pass (drafting ahead) slows it, and one in another process makes every
# drafted step wait on a round trip (docs/results.md).
SMALL_HOST_CORES = 8


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (a pod's limit)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def requested_threads() -> int | None:
    """OMP_NUM_THREADS when set (a positive integer, else SystemExit), None when unset."""
    raw = os.environ.get("OMP_NUM_THREADS", "")
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise SystemExit(f"OMP_NUM_THREADS must be a positive integer, got {raw!r}")
    return int(raw)


def configure_threads() -> int:
    """OMP_NUM_THREADS when set (a positive integer), else every available core. Returns the count."""
    requested = requested_threads()
    if requested is not None:
        threads, source = requested, "OMP_NUM_THREADS"
    else:
        threads, source = available_cores(), "available cores"
    torch.set_num_threads(threads)
    log.info("torch uses %d CPU thread(s) (%s)", threads, source)
    return threads


@contextlib.contextmanager
def one_thread(device: torch.device):
    """Run the block on one CPU thread (a no-op elsewhere and when there is only one)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# A service runs torch on one thread and gRPC on the event loop's. Between two torch ops the
# torch thread needs the GIL back; while the loop streams a step's chunks it holds the GIL, and
# CPython only forces a hand-over after the switch interval (5 ms by default). 0.2 ms bounds that
# wait: plain decoding through the services at c = 16 +4.6% (docs/results.md); 0.05-1 ms measured alike.
SERVICE_SWITCH_INTERVAL_S = 0.0002


def share_gil_with_torch_thread() -> None:
    """For a process whose torch thread shares the GIL with an asyncio event loop."""
    sys.setswitchinterval(SERVICE_SWITCH_INTERVAL_S)
