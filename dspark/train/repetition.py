"""Spotting a degenerate loop in a response while it is being generated.

A small target often falls into repeating the same few lines until the length cap; with
sampling the repeats are close, not exact. Measured on the first shard: a fifth of the
answers hit the 512-token cap and carried half of the response tokens, most of them loops.
Stopping an answer once its recent window is mostly repeated n-grams keeps a few repeats
(the drafter should see loops: the target makes them when serving too) and spends the
generation time on new answers instead.
"""
from __future__ import annotations


def is_looping(tokens: list[int], window: int = 192, n: int = 8, max_unique_share: float = 0.35) -> bool:
    """True when, in the last `window` tokens, at most max_unique_share of the n-grams are distinct."""
    if len(tokens) < window:
        return False
    tail = tokens[-window:]
    grams = [tuple(tail[i:i + n]) for i in range(window - n + 1)]
    return len(set(grams)) <= max_unique_share * len(grams)
