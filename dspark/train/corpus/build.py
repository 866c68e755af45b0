"""Assemble the training prompt corpus: Magpie samples, local-text prompts, templates; filter,
deduplicate, drop anything sharing a 13-gram with the eval sets; write jsonl.gz and print the mix.

    python -m dspark.train.corpus.build --magpie datasets/train/magpie_raw.jsonl.gz \
        --out datasets/train/prompts.jsonl.gz
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
from collections import Counter
from pathlib import Path

from dspark.train.corpus.dedup import deduplicate
from dspark.train.corpus.eval_overlap import eval_grams, overlaps
from dspark.train.corpus.filters import good_user_query
from dspark.train.corpus.local_text import local_text_prompts
from dspark.train.corpus.templates import template_prompts


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl_gz(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0: the same records give the same bytes, so a rebuild does not churn git.
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        for r in records:
            gz.write((json.dumps(r, ensure_ascii=False) + "\n").encode())


def magpie_prompts(raw: list[dict]) -> list[dict]:
    return [dict(source="magpie", category=r["category"], turns=[r["text"].strip()])
            for r in sorted(raw, key=lambda r: r["i"]) if r["finish"] == "stop" and good_user_query(r["text"])]


def mix_table(records: list[dict]) -> str:
    by = Counter((r["source"], r["category"]) for r in records)
    sources = sorted({s for s, _ in by})
    cats = sorted({c for _, c in by})
    lines = ["| source | " + " | ".join(cats) + " | total |", "|---" * (len(cats) + 2) + "|"]
    for s in sources:
        row = [by[(s, c)] for c in cats]
        lines.append(f"| {s} | " + " | ".join(map(str, row)) + f" | {sum(row)} |")
    totals = [sum(by[(s, c)] for s in sources) for c in cats]
    lines.append("| total | " + " | ".join(map(str, totals)) + f" | {sum(totals)} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--magpie", nargs="*", default=[], help="raw samples from dspark.train.corpus.magpie")
    ap.add_argument("--out", default="datasets/train/prompts.jsonl.gz")
    ap.add_argument("--templates", type=int, default=15000)
    ap.add_argument("--docstrings", type=int, default=3000)
    ap.add_argument("--man-pages", type=int, default=1500)
    ap.add_argument("--paragraphs", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--append", action="store_true",
                    help="keep --out's records and ids, add only new prompts after them (a running "
                         "regeneration keeps its ids; e.g. more Magpie samples with every other count 0)")
    args = ap.parse_args(argv)

    existing = read_jsonl(Path(args.out)) if args.append and Path(args.out).exists() else []
    candidates = [{k: v for k, v in r.items() if k != "id"} for r in existing]
    for path in args.magpie:
        candidates += magpie_prompts(read_jsonl(Path(path)))
    candidates += local_text_prompts(args.docstrings, args.man_pages, args.paragraphs, args.seed)
    candidates += template_prompts(args.templates, args.seed)
    print(f"{len(candidates)} candidates", flush=True)
    # Existing records come first, so a new prompt is what gets dropped when the two collide.
    old = {id(r) for r in candidates[:len(existing)]}
    kept = [r for r in deduplicate(candidates) if id(r) not in old]
    print(f"{len(kept)} new after exact and near-duplicate removal", flush=True)
    index = eval_grams()
    clean = [r for r in kept if not overlaps("\n".join(r["turns"]), index)]
    print(f"{len(clean)} after dropping {len(kept) - len(clean)} with a 13-gram in datasets/eval", flush=True)
    random.Random(args.seed + len(existing)).shuffle(clean)
    start = 1 + max((int(r["id"][1:]) for r in existing), default=-1)
    records = existing + [dict(id=f"p{start + i:06d}", **r) for i, r in enumerate(clean)]
    write_jsonl_gz(Path(args.out), records)
    print(mix_table(records))
    print(f"wrote {len(records)} prompts to {args.out}")


if __name__ == "__main__":
    main()
