"""Stage 4: fit STS temperatures on a held-out split and store them with the drafter.

Held-out prompts are training-style prompts the drafter never saw: the corpus records that the
trainer holds out by a hash of their id (dspark.train.regen_data.is_held_out), never the
evaluation sets. The drafter runs with the target in the loop, verifying full blocks, at each
temperature asked (served traffic mixes greedy and sampled requests, so the fit pools them), and
every (confidence logits, accepted length) pair is a label.

    python -m dspark.train.calibrate --drafter drafters/smollm2-135m/dspark --prompts 64
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dspark.models.loader import DEFAULT_MODEL, load_model
from dspark.sched.calibration import fit_sts
from dspark.train.evaluate import Run, confidence_quality, run_drafter
from dspark.train.regen_data import HELD_OUT_SHARE, is_held_out

CORPUS = Path(__file__).resolve().parents[2] / "datasets" / "train" / "prompts.jsonl.gz"


def held_out_prompts(corpus: str | Path, count: int, share: float = HELD_OUT_SHARE) -> list[str]:
    """First turns of `count` held-out corpus records, in an order fixed by a hash of their ids
    (so every category shows up, not just the corpus file's first source). A first turn that a
    training record also opens with (a multi-turn record built on the same question) is left out."""
    with gzip.open(corpus, "rt") as f:
        records = [json.loads(line) for line in f if line.strip()]
    trained = {r["turns"][0] for r in records if not is_held_out(r["id"], share)}
    held = sorted((r for r in records if is_held_out(r["id"], share) and r["turns"][0] not in trained),
                  key=lambda r: hashlib.sha256(r["id"].encode()).digest())
    return list(dict.fromkeys(r["turns"][0] for r in held))[:count]


def main(argv=None):
    from dspark.drafters.shipped import load_drafter_for

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", type=int, default=64, help="held-out corpus prompts per temperature")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--corpus", default=str(CORPUS), help="prompt corpus (dspark.train.corpus.build)")
    ap.add_argument("--held-out-share", type=float, default=HELD_OUT_SHARE, help="as the trainer's --held-out-share")
    args = ap.parse_args(argv)

    loaded = load_model(args.model)
    drafter = load_drafter_for(loaded, args.drafter)
    if not drafter.has_confidence:
        raise SystemExit(f"{drafter.kind} has no confidence head: nothing to calibrate")
    texts = held_out_prompts(args.corpus, args.prompts, args.held_out_share)
    prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    run = Run()
    bar = tqdm(total=len(args.temperatures) * len(prompts) * args.max_tokens, desc="calibrate", unit="tok")
    for temperature in args.temperatures:
        run.add(run_drafter(loaded.model, drafter, prompts, temperature, args.max_tokens, progress=bar.update))
    z, acc, ver = np.asarray(run.conf_logits), np.asarray(run.accepted), np.asarray(run.verified)
    bar.close()
    temps = fit_sts(z, acc, ver)
    quality = confidence_quality(run, temps)
    path = Path(args.drafter)
    (path / "calibration.json").write_text(json.dumps(dict(
        temperatures=[float(t) for t in temps], drafter_version=drafter.version, blocks=len(z),
        temperatures_sampled=args.temperatures, prompts=len(texts), corpus=Path(args.corpus).name,
        held_out_share=args.held_out_share, fit_quality=quality), indent=1))
    print(f"STS temperatures {np.round(temps, 3).tolist()} from {len(z)} blocks; mean ECE "
          f"{quality['raw']['mean_ece']:.4f} -> {quality['sts']['mean_ece']:.4f} (fit split)")


if __name__ == "__main__":
    main()
