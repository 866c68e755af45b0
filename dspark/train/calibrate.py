"""Stage 4: fit STS temperatures on a held-out split and store them with the drafter.

Held-out prompts are training-style prompts the drafter never saw (a different seed of the
prompt builder), never the evaluation sets. The drafter runs with the target in the loop,
verifying full blocks, and every (confidence logits, accepted length) pair is a label.

    python -m dspark.train.calibrate --drafter drafters/smollm2-135m/dspark --prompts 48
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from dspark.models.loader import DEFAULT_MODEL, load_model
from dspark.sched.calibration import fit_sts
from dspark.train.evaluate import confidence_quality, run_drafter
from dspark.train.prompts import build_prompts


def main(argv=None):
    from dspark.drafters.shipped import load_drafter_for

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=12345, help="prompt-builder seed; training used another")
    args = ap.parse_args(argv)

    loaded = load_model(args.model)
    drafter = load_drafter_for(loaded, args.drafter)
    if not drafter.has_confidence:
        raise SystemExit(f"{drafter.kind} has no confidence head: nothing to calibrate")
    vocab = [loaded.tokenizer.tok.id_to_token(i) for i in range(loaded.tokenizer.vocab_size)]
    texts = build_prompts(args.prompts, vocab, seed=args.seed)
    prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    run = run_drafter(loaded.model, drafter, prompts, args.temperature, args.max_tokens)
    z, acc, ver = np.asarray(run.conf_logits), np.asarray(run.accepted), np.asarray(run.verified)
    temps = fit_sts(z, acc, ver)
    quality = confidence_quality(run, temps)
    path = Path(args.drafter)
    (path / "calibration.json").write_text(json.dumps(dict(
        temperatures=[float(t) for t in temps], drafter_version=drafter.version, blocks=len(z),
        temperature=args.temperature, prompts=args.prompts, seed=args.seed, fit_quality=quality), indent=1))
    print(f"STS temperatures {np.round(temps, 3).tolist()} from {len(z)} blocks; mean ECE "
          f"{quality['raw']['mean_ece']:.4f} -> {quality['sts']['mean_ece']:.4f} (fit split)")


if __name__ == "__main__":
    main()
