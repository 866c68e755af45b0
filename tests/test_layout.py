"""The layout docs/ARCHITECTURE.md promises: the core imports neither gRPC nor Redis, and the
model does not import the engine that drives it (no import cycle)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORE = ["models", "engine", "speculative", "drafters", "sched", "train", "sampling.py"]


def core_modules() -> list[str]:
    names = []
    for part in CORE:
        path = REPO / "dspark" / part
        files = [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))
        names += [".".join(f.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__") for f in files]
    return names


def test_core_modules_import_no_grpc_and_no_redis():
    modules = core_modules()
    assert len(modules) > 30
    code = ("import importlib, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'redis', 'google')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_model_does_not_import_the_engine():
    offenders = {str(f.relative_to(REPO)): sorted(m for m in imports_of(f) if m.startswith("dspark.engine"))
                 for f in (REPO / "dspark" / "models").rglob("*.py")}
    assert not any(offenders.values()), offenders
