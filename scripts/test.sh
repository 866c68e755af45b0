#!/usr/bin/env bash
# Set up, lint (ruff, pyproject.toml) and run the whole test suite (needs Redis on 127.0.0.1:6379; started here if absent).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh test
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
  for _ in $(seq 50); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.1; done
fi
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
# CI hosts differ (AVX-512 or AVX2 only) and each has its own kernel paths: on an AVX-512 host the
# whole-suite run tests those, so the kernel tests run again on the AVX2 build too.
if [ $# -eq 0 ] && grep -qw avx512f /proc/cpuinfo; then
  DSPARK_CPU_ISA=avx2 .venv/bin/python -m pytest -q tests/test_cpu_kernels.py tests/test_precision.py tests/test_drafters.py
fi
