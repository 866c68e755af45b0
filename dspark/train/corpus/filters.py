"""Quality filters for prompts sampled from the target: length, language, repetition."""
from __future__ import annotations

import re

# Frequent English function words: a prompt in English contains some of them.
ENGLISH_WORDS = frozenset(
    ["the", "a", "an", "and", "or", "of", "to", "in", "on", "for", "with", "is", "are", "was", "be", "can", "you",
     "your", "i", "me", "my", "it", "this", "that", "what", "how", "why", "which", "who", "when", "where", "do",
     "does", "please", "write", "explain", "give", "make", "use", "about", "from", "as", "by", "if", "not"])
WORD = re.compile(r"[A-Za-z']+")


def ascii_share(text: str) -> float:
    return sum(c.isascii() for c in text) / max(1, len(text))


def looks_english(text: str) -> bool:
    words = [w.lower() for w in WORD.findall(text)]
    if len(words) < 4 or ascii_share(text) < 0.97:
        return False
    return sum(w in ENGLISH_WORDS for w in words) / len(words) >= 0.15


def is_repetitive(text: str, n: int = 3) -> bool:
    """True when word n-grams repeat a lot (a sampled loop) or one word dominates."""
    words = text.lower().split()
    if len(words) < 2 * n:
        return False
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if len(set(grams)) / len(grams) < 0.7:
        return True
    top = max(words.count(w) for w in set(words))
    return len(words) >= 12 and top / len(words) > 0.25


def good_user_query(text: str, min_chars: int = 20, max_chars: int = 1200) -> bool:
    """A sampled user turn worth keeping: sane length, English, no loops, no template tokens."""
    text = text.strip()
    if not min_chars <= len(text) <= max_chars or "<|" in text or "|>" in text:
        return False
    return looks_english(text) and not is_repetitive(text)
