"""13-gram contamination check against the vendored evaluation prompts (datasets/eval/*.jsonl).

Grams are over whitespace tokens of the lowercased text, the usual decontamination unit.
"""
from __future__ import annotations

import json
from pathlib import Path

EVAL_DIR = Path(__file__).resolve().parents[3] / "datasets" / "eval"
N = 13


def grams(text: str, n: int = N) -> set[tuple[str, ...]]:
    words = text.lower().split()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def eval_texts(eval_dir: Path = EVAL_DIR) -> dict[str, list[str]]:
    """Every turn of every eval file, by file name."""
    out = {}
    for path in sorted(eval_dir.glob("*.jsonl")):
        out[path.name] = [t for line in path.read_text().splitlines() if line.strip()
                          for t in json.loads(line)["turns"]]
    return out


def eval_grams(eval_dir: Path = EVAL_DIR) -> set[tuple[str, ...]]:
    return {g for texts in eval_texts(eval_dir).values() for t in texts for g in grams(t)}


def overlaps(text: str, index: set[tuple[str, ...]]) -> bool:
    return not grams(text).isdisjoint(index)
