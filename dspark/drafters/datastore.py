"""A datastore of the target's own answers: where the current text's suffix occurred in them, what the
target went on to say (retrieval drafting, as REST and SuffixDecoding do it).

Why it pays: a small target answers alike across prompts (the same phrasing of a solution, the same code
scaffolding), so the continuation of the text's last few tokens in millions of its earlier answers is
often what it says next. Prompt lookup (ngram_index.py) covers what repeats within one request; this
covers what repeats across requests, at the cost of a few binary searches instead of a draft.

The answers are concatenated, separated by SEP, and read backwards: then the current suffix read
backwards (anchor first) is a prefix pattern, and the suffixes that start with a longer pattern are a
sub-range of those that start with a shorter one. One pass of binary searches, a token at a time,
finds the longest match. Its occurrences' next tokens (forwards) give the guess: at each slot the most
frequent next token among the occurrences that followed the guess so far, with its share of them.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter
from pathlib import Path

import numpy as np

SEP = -1  # between answers: matches no token, ends every continuation
FEW_OCCURRENCES = 64  # counted in plain Python at most (_most_frequent_next)
SORT_DEPTH = 16  # suffixes are ordered by their first 16 tokens: matches longer than that add nothing


def suffix_order(text: np.ndarray, depth: int = SORT_DEPTH) -> np.ndarray:
    """Start positions of `text` ordered by their first `depth` tokens (prefix doubling: ranks by
    1, 2, 4, ... tokens; ties beyond `depth` stay in position order)."""
    n = text.size
    rank = np.unique(text, return_inverse=True)[1].astype(np.int64) + 1  # 0 = past the end
    h = 1
    while h < depth:
        after = np.zeros(n, dtype=np.int64)
        after[:n - h] = rank[h:]
        rank = np.unique(rank * (n + 1) + after, return_inverse=True)[1].astype(np.int64) + 1
        h *= 2
    return np.argsort(rank, kind="stable").astype(np.int32)


def prefix_keys(reversed_text: np.ndarray, order: np.ndarray, most: int = 4) -> tuple[int, int, np.ndarray]:
    """(base, depth, keys): each suffix in `order`, its first `depth` tokens packed into one int64 (token
    + 2 in base `base`, past the end 0 and SEP 1, as suffix_order ranks them), so the keys ascend along
    the order and the suffixes that start with a given few tokens are one range of them. depth: as many
    tokens as fit in 63 bits, at most `most` (4 for SmolLM2's 49,152 tokens, 3 for Llama's 128,256)."""
    base = int(reversed_text.max(initial=0)) + 3
    depth = 1
    while depth < most and base ** (depth + 1) < 2 ** 63:
        depth += 1
    n = reversed_text.size
    keys = np.zeros(order.size, dtype=np.int64)
    for j in range(depth):
        at = order.astype(np.int64) + j
        digit = np.where(at < n, reversed_text[np.minimum(at, n - 1)].astype(np.int64) + 2, 0)
        keys = keys * base + digit
    return base, depth, keys


class Datastore:
    def __init__(self, answers, min_n: int = 3, max_n: int = SORT_DEPTH, max_occurrences: int = 512):
        """answers: token-id sequences (the target's answers), or a prebuilt (reversed text, order) pair
        from `load`. min_n: shortest match that makes a guess; max_occurrences: how many occurrences of
        a match at most are counted (an even sample of them), which bounds the cost of a short match."""
        if not 1 <= min_n <= max_n <= SORT_DEPTH:
            raise ValueError(f"need 1 <= min_n <= max_n <= {SORT_DEPTH}, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.max_occurrences = min_n, max_n, max_occurrences
        if isinstance(answers, tuple):
            self.reversed_text, self.order = answers
        else:
            pieces = [np.append(np.asarray(a, dtype=np.int32), np.int32(SEP)) for a in answers if len(a)]
            text = np.concatenate(pieces) if pieces else np.array([SEP], dtype=np.int32)
            self.reversed_text = np.ascontiguousarray(text[::-1])
            self.order = suffix_order(self.reversed_text)
        # The binary searches read one element at a time (~20 per token matched): through a memoryview
        # that is a plain int each, several times cheaper than numpy's scalar indexing, with no copy.
        self._text = memoryview(self.reversed_text)
        self._order = memoryview(self.order)
        self._base, self._key_depth, keys = prefix_keys(self.reversed_text, self.order)
        self._keys = memoryview(keys)

    @property
    def tokens(self) -> int:
        return int(np.count_nonzero(self.reversed_text != SEP))

    def save(self, path: str | Path) -> None:
        np.savez_compressed(path, reversed_text=self.reversed_text, order=self.order)

    @classmethod
    def load(cls, path: str | Path, **kw) -> Datastore:
        with np.load(path) as f:
            return cls((f["reversed_text"].astype(np.int32), f["order"].astype(np.int32)), **kw)

    def match(self, text: list[int]) -> tuple[int, int, int]:
        """(n, lo, hi): the longest suffix of `text` (at most max_n tokens) that occurs in the answers,
        and the range of `order` where it starts. n = 0 when not even one token occurs."""
        size, order, rev = len(self._text), self._order, self._text
        # The first few tokens: one binary search (in C) over the suffixes' packed prefixes a length,
        # longest first; the rest a token at a time, each in the range the tokens before it left.
        depth = min(self._key_depth, self.max_n, len(text))
        n, lo, hi = 0, 0, len(order)
        key = 0
        for j in range(depth):
            key = key * self._base + text[-1 - j] + 2
        for j in range(depth, 0, -1):
            scale = self._base ** (self._key_depth - j)
            new_lo = bisect_left(self._keys, key * scale)
            new_hi = bisect_left(self._keys, (key + 1) * scale, new_lo)
            if new_lo < new_hi:
                n, lo, hi = j, new_lo, new_hi
                break
            key //= self._base
        if n < depth:
            return n, lo, hi  # a longer suffix would start with this one plus a token that never follows it
        for j in range(n, min(self.max_n, len(text))):
            token = text[-1 - j]
            if hi - lo == 1:  # one occurrence left: compare it token by token
                p = order[lo] + j
                if p >= size or rev[p] != token:
                    break
                n = j + 1
                continue

            def at(i: int, j=j) -> int:  # token j of the suffix starting at order[i]; -2 past the end
                p = order[i] + j
                return rev[p] if p < size else -2

            new_lo = bisect_left(range(lo, hi), token, key=at) + lo
            new_hi = bisect_right(range(new_lo, hi), token, key=at) + new_lo
            if new_lo == new_hi:
                break
            lo, hi, n = new_lo, new_hi, j + 1
        return n, lo, hi

    def continuation(self, text: list[int], k: int) -> tuple[list[int], list[float], int, int]:
        """Up to k guessed tokens after `text` (its last token the anchor), each the most frequent next
        token among the occurrences that agree with the guess so far, and its share of them. Returns
        (tokens, shares, n matched, occurrences); no tokens when the match is shorter than min_n."""
        n, lo, hi = self.match(text)
        if n < self.min_n:
            return [], [], n, 0
        starts = self.order[lo:hi]
        if starts.size > self.max_occurrences:
            starts = starts[:: -(-starts.size // self.max_occurrences)]
        occurrences = int(hi - lo)
        guess, shares = [], []
        for j in range(k):
            if len(starts) == 1:  # one occurrence left (most long matches): the rest of its answer as it is
                rest = self.reversed_text[max(0, int(starts[0]) - k):max(0, int(starts[0]) - j)][::-1].tolist()
                rest = rest[:rest.index(SEP)] if SEP in rest else rest
                guess += rest
                shares += [1.0] * len(rest)
                break
            token, share, starts = self._most_frequent_next(starts, j)
            if token is None:
                break
            guess.append(token)
            shares.append(share)
        return guess, shares, n, occurrences

    def _most_frequent_next(self, starts, j: int):
        """(token, its share, the occurrences it follows) at slot j after the occurrences `starts`: the most
        frequent next token, the smallest on a tie, an answer's end never; (None, 0, starts) when every
        occurrence has ended. A few occurrences are counted in plain Python, where numpy's cost a call
        would be most of the work; many in numpy."""
        if len(starts) <= FEW_OCCURRENCES:
            rev = self._text
            following = [rev[s - 1 - j] if s > j else SEP for s in starts]  # forwards is backwards here
            counts = Counter(t for t in following if t != SEP)
            if not counts:
                return None, 0.0, starts
            top = max(counts.values())
            token = min(t for t, c in counts.items() if c == top)
            return token, top / len(starts), [s for s, t in zip(starts, following) if t == token]
        before = starts - 1 - j
        following = np.where(before >= 0, self.reversed_text[np.maximum(before, 0)], SEP)
        values, counts = np.unique(following, return_counts=True)
        counts[values == SEP] = 0
        best = int(np.argmax(counts))
        if counts[best] == 0:
            return None, 0.0, starts
        kept = starts[following == values[best]]
        return int(values[best]), float(counts[best] / starts.size), kept.tolist() if kept.size <= FEW_OCCURRENCES else kept
