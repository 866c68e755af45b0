"""Drafters for a loaded target: a checkpoint directory, or one shipped under drafters/<model>/<kind>."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark.drafters.checkpoint import load_calibration, load_drafter
from dspark.drafters.datastore import Datastore
from dspark.models.precision import apply_precision

SHIPPED_DRAFTERS = Path(__file__).resolve().parents[2] / "drafters"


DATASTORE_FILE = "datastore.npz"  # drafters/<model>/: the target's own answers (dspark/drafters/datastore.py)


def default_drafter_dir(model_name: str, kind: str = "dspark") -> Path | None:
    path = SHIPPED_DRAFTERS / model_name / kind
    return path if (path / "config.json").exists() else None


def drafter_dir(model_name: str, drafter: str) -> Path | None:
    """A checkpoint directory as given, else the shipped one of that kind for this model, else None."""
    path = Path(drafter)
    return path if (path / "config.json").exists() else default_drafter_dir(model_name, drafter)


def load_drafter_for(loaded, drafter: str | None, precision: str = "fp32"):
    """'none' -> no drafter; a path; or a kind name looked up among the shipped drafters.
    precision: the kernels of the drafter's own matmuls (dspark.models.precision). The drafter
    runs on the target's device and carries its checkpoint's offline STS fit as
    `sts_temperatures` (float64 [gamma], None without calibration.json)."""
    if drafter in (None, "none"):
        return None
    path = drafter_dir(loaded.name, drafter)
    if path is None:
        return None
    model = loaded.model
    module = load_drafter(path, model.model.embed_tokens.weight, model.output_weight).to(model.device).eval()
    apply_precision(module, precision)
    temperatures = load_calibration(path, module.version) if module.has_confidence else None
    module.sts_temperatures = np.array(temperatures, dtype=np.float64) if temperatures else None
    return module


def load_datastore_for(model_name: str, choice: str = "auto") -> Datastore | None:
    """'off' -> None; 'auto' -> the one shipped for this target (drafters/<model>/datastore.npz), None
    when there is none; else a path to a datastore file (built by dspark.train.build_datastore)."""
    if choice == "off":
        return None
    path = SHIPPED_DRAFTERS / model_name / DATASTORE_FILE if choice == "auto" else Path(choice)
    if not path.exists():
        if choice == "auto":
            return None
        raise FileNotFoundError(f"no datastore at {path}")
    return Datastore.load(path)
