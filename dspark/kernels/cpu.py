"""C++ kernels for the CPU path, compiled for this machine on first use and cached on disk.

torch.utils.cpp_extension builds them with the host's compiler and `-march=native` (AVX-512 where
the CPU has it). The build directory is keyed by the source, torch's version and the CPU's flags,
so a cache copied to another machine is rebuilt rather than run on the wrong instructions.
`DSPARK_KERNEL_CACHE` moves it (default ~/.cache/dspark/kernels); `DSPARK_CPU_KERNELS=0` turns
the kernels off (the model then runs torch's SDPA and norm, as before they existed);
`DSPARK_CPU_ISA=avx2` builds them as for a CPU without AVX-512 (see precision.cpu_flags).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

from dspark.models.precision import AVX2_ONLY, cpu_flags

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name(name)
           for name in ("cpu_kernels.cpp", "gguf_matmul.cpp", "gguf_q8_matmul.cpp", "int8_matmul.cpp",
                        "draft_chain.cpp", "layer_stack.cpp")]
HEADERS = [Path(__file__).with_name("release_gil.h")]
FLAGS = ["-O3", "-march=native", "-fopenmp"] + (["-mno-avx512f", "-mno-avxvnni", "-mno-amx-tile"] if AVX2_ONLY else [])


def _build_dir() -> Path:
    key = hashlib.sha256()
    # The source's path and the interpreter too: build.ninja names both, so two checkouts (a
    # training worktree beside the main one) sharing a directory would rebuild in turn, each
    # waiting on the other's lock.
    for part in (*(s.read_bytes() for s in SOURCES + HEADERS), torch.__version__.encode(),
                 " ".join(sorted(cpu_flags())).encode(), " ".join(FLAGS).encode(),
                 *(str(s.resolve()).encode() for s in SOURCES), sys.executable.encode()):
        key.update(part)
    root = Path(os.environ.get("DSPARK_KERNEL_CACHE", Path.home() / ".cache" / "dspark" / "kernels"))
    path = root / key.hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    return path


def kernels():
    """The compiled module (`cached_attention`, `rms_norm`, `rope_cache_attention`, `gguf_linear`...), or None where
    it cannot be built (no compiler) or is turned off: the model then takes its SDPA path, slower
    but exact too."""
    return None if os.environ.get("DSPARK_CPU_KERNELS", "1") == "0" else _build()


@functools.cache
def _build():
    try:
        import ninja  # the build tool cpp_extension runs, from the venv even when it is not activated
        from torch.utils import cpp_extension

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])

        return cpp_extension.load("dspark_cpu_kernels", [str(s) for s in SOURCES], extra_cflags=FLAGS,
                                  extra_ldflags=["-fopenmp"], build_directory=str(_build_dir()), verbose=False)
    except Exception as error:  # a missing compiler or ninja: fall back, say why once
        log.warning("CPU kernels unavailable, attention runs on SDPA (slower): %s", error)
        return None
