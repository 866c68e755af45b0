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
