"""The lookup datastore of a target (dspark/drafters/datastore.py) from its regenerated conversations.

    python -m dspark.train.build_datastore --regen datasets/train/regen --out drafters/smollm2-135m/datastore.npz

Every record's turns, prompt and answer, back to back: the target's answers repeat their prompts'
phrasing, so the prompts help the matches. The held-out records (regen_data.is_held_out) stay out,
so that the STS fit and any measurement on them see text the datastore has not.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from dspark.drafters.datastore import Datastore
from dspark.train.regen_data import HELD_OUT_SHARE, is_held_out, read_records


def conversations(regen_dir: str | Path) -> list[list[int]]:
    """Token ids of every training record's conversation (held-out records excluded)."""
    out = []
    for record in read_records(regen_dir):
        if is_held_out(record["id"], HELD_OUT_SHARE):
            continue
        out.append([t for turn in record["turns"] for t in turn["prompt_ids"] + turn["response_ids"]])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regen", default="datasets/train/regen", help="directory of regeneration shards")
    ap.add_argument("--out", required=True, help="datastore file (.npz)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    texts = conversations(args.regen)
    print(f"{len(texts)} conversations, {sum(map(len, texts)):,} tokens", flush=True)
    datastore = Datastore(texts)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    datastore.save(args.out)
    print(f"datastore: {datastore.tokens:,} tokens, {Path(args.out).stat().st_size / 1e6:.1f} MB at {args.out} "
          f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
