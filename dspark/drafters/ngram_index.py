"""One request's decided tokens and where each short n-gram of them last ended, so that the
continuation of the text's current suffix can be looked up in O(1) (prompt lookup decoding).

Why it pays here: answers repeat their prompt (code, names, numbers) and a small target repeats
itself (loops); where the current suffix occurred before, what followed it then is a likely draft.
"""
from __future__ import annotations


class NgramIndex:
    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}  # n-gram -> position of its last token, latest occurrence

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._last_end[tuple(self.tokens[end - n + 1:end + 1])] = end

    def sync(self, tokens: list[int], start: int = 0) -> None:
        """`tokens` are positions start.. of the text: append those past what is indexed (the rest
        is known already, e.g. from an earlier sync with the whole text)."""
        if len(self.tokens) < start + len(tokens):
            self.append(tokens[max(0, len(self.tokens) - start):])

    def truncate(self, length: int) -> None:
        if length >= len(self.tokens):
            return
        kept = self.tokens[:length]  # rare (a context the verifier rolled back): rebuild
        self.tokens, self._last_end = [], {}
        self.append(kept)

    def continuation(self, anchor: int, k: int) -> tuple[list[int], int]:
        """Up to k tokens after `anchor` (the token after the indexed ones): what followed the latest
        earlier occurrence of the longest suffix n-gram, re-looked-up as the guess grows (so a loop
        is followed round). Returns (tokens, n of the first match; 0 when nothing matched)."""
        # The text is tokens + [anchor] + out; only its last max_n tokens are matched, so only those
        # are kept (no copy of the whole text per call: this runs for every request every step).
        suffix, out, first_n = self.tokens[-self.max_n:] + [anchor], [], 0
        while len(out) < k:
            n, end = self._match(suffix)
            if not n:
                break
            first_n = first_n or n
            need = k - len(out)
            take = self.tokens[end + 1:end + 1 + need]  # end < len(tokens): what followed, anchor on
            take += ([anchor] + out)[:need - len(take)]
            out += take
            suffix = (suffix + take)[-self.max_n:]
        return out, first_n

    def _match(self, suffix: list[int]) -> tuple[int, int]:
        """(n, end) of the longest suffix of `suffix` seen in the indexed tokens, else (0, -1). It
        ends past them (at the anchor or a guess), so any hit is an earlier occurrence."""
        for n in range(min(self.max_n, len(suffix)), self.min_n - 1, -1):
            end = self._last_end.get(tuple(suffix[-n:]))
            if end is not None:
                return n, end
        return 0, -1
