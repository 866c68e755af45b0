"""Deduplication: exact after normalization, then near-duplicates by word-shingle MinHash.

Near-duplicate = Jaccard similarity of word 5-gram shingles >= threshold. MinHash with LSH
banding finds candidate pairs without comparing every pair; candidates are confirmed with
the exact Jaccard of their shingle sets. The first record of a group is kept.
"""
from __future__ import annotations

import hashlib
import re
from collections import defaultdict

import numpy as np

_PUNCT = re.compile(r"[^\w\s]")


def normalize(text: str) -> str:
    """Lowercase, punctuation dropped, whitespace collapsed."""
    return " ".join(_PUNCT.sub(" ", text.lower()).split())


def shingles(text: str, n: int = 5) -> set[int]:
    words = normalize(text).split()
    grams = [" ".join(words[i:i + n]) for i in range(max(1, len(words) - n + 1))]
    return {int.from_bytes(hashlib.blake2b(g.encode(), digest_size=8).digest(), "little") for g in grams}


class NearDuplicateFilter:
    def __init__(self, threshold: float = 0.8, num_perm: int = 64, bands: int = 16, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.threshold, self.bands, self.rows = threshold, bands, num_perm // bands
        self.mersenne = np.uint64((1 << 61) - 1)
        self.a = rng.integers(1, 1 << 61, num_perm, dtype=np.uint64)
        self.b = rng.integers(0, 1 << 61, num_perm, dtype=np.uint64)
        self.buckets: dict[tuple, list[int]] = defaultdict(list)
        self.kept: list[set[int]] = []

    def _signature(self, sh: set[int]) -> np.ndarray:
        x = np.fromiter(sh, dtype=np.uint64) % self.mersenne
        # Universal hashing mod 2^61-1; uint64 products wrap, which keeps them well mixed.
        return ((x[:, None] * self.a[None, :] + self.b[None, :]) % self.mersenne).min(axis=0)

    def add(self, text: str) -> bool:
        """True (and remembered) when text is not a near-duplicate of anything added before."""
        sh = shingles(text)
        sig = self._signature(sh)
        keys = [(band, sig[band * self.rows:(band + 1) * self.rows].tobytes()) for band in range(self.bands)]
        for key in keys:
            for j in self.buckets.get(key, ()):
                other = self.kept[j]
                if len(sh & other) / len(sh | other) >= self.threshold:
                    return False
        idx = len(self.kept)
        self.kept.append(sh)
        for key in keys:
            self.buckets[key].append(idx)
        return True


def deduplicate(records: list[dict], threshold: float = 0.8) -> list[dict]:
    """Records whose joined turns are neither exact (normalized) nor near duplicates of an earlier one."""
    seen, near, out = set(), NearDuplicateFilter(threshold), []
    for r in records:
        text = "\n".join(r["turns"])
        key = normalize(text)
        if key in seen:
            continue
        seen.add(key)
        if near.add(text):
            out.append(r)
    return out
