"""Token ids -> streamed text deltas, with stop strings.

Decoding is incremental: a push decodes only its new tokens behind a few tokens of context
(tokenizers merge bytes and clean up spaces across tokens, so the context's own text is decoded
too and cut off), and falls back to decoding everything when the window's text does not start
with its context's. Decoding the whole output on every push cost O(length) per token: 52 us a
push at 512 tokens, 196 us at 2,000, for every request of every step, on the event loop. Only
what is certain is sent: an incomplete UTF-8 character at the end ("\ufffd") waits for its next bytes,
and a tail that could be the start of a stop string waits until it is clearly not one. When a
stop string is hit inside a multi-token burst (accepted draft tokens), the tokens after the one
that completes it are dropped (`overshoot`), so the token ids agree with the text.
"""
from __future__ import annotations

from collections.abc import Callable

CONTEXT_TOKENS = 4  # tokens decoded before a push's own, so merges across the boundary come out right


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] = (),
                 prefix_tokens: list[int] = (), prefix_text: str = ""):
        """prefix_*: output a previous verifier already streamed (a resumed request)."""
        self.decode, self.stop = decode, [s for s in stop if s]
        self.tokens = list(prefix_tokens)
        text = decode(self.tokens) if self.tokens else ""
        self.sent = len(prefix_text) if text.startswith(prefix_text) else len(text)
        self.overshoot = 0  # tokens of the last push past the one that completed a stop string
        self._stable, self._stable_text, self._context, self._context_text = 0, "", 0, ""
        self._settle(text)

    def _settle(self, text: str) -> None:
        """`text` is decode(tokens): the next push decodes from here (unless it ends mid-character)."""
        if text.endswith("\ufffd"):
            return
        self._stable, self._stable_text = len(self.tokens), text
        self._context = max(0, self._stable - CONTEXT_TOKENS)
        self._context_text = self.decode(self.tokens[self._context:self._stable])

    def _text(self) -> str:
        """decode(self.tokens), decoding only what came after the last settled point."""
        window = self.decode(self.tokens[self._context:])
        if window.startswith(self._context_text):
            return self._stable_text + window[len(self._context_text):]
        return self.decode(self.tokens)

    def push(self, tokens: list[int], final: bool = False) -> tuple[str, bool]:
        """Add decided tokens; returns (text to send now, whether a stop string was hit)."""
        self.tokens.extend(tokens)
        text = self._text()
        hits = [(i, s) for i, s in ((text.find(s, self.sent), s) for s in self.stop) if i >= 0]
        if hits:
            start, stop = min(hits)
            self.overshoot = len(tokens) - self._tokens_through(stop, len(tokens))
            del self.tokens[len(self.tokens) - self.overshoot:]
            delta = text[self.sent:start]
            self.sent = start
            return delta, True  # the stream ends here: nothing is pushed after a stop
        end = len(text)
        if not final:
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
            end -= self._stop_prefix(text[self.sent:end])
        delta = text[self.sent:end]
        self.sent = end
        self._settle(text)
        return delta, False

    def _tokens_through(self, stop: str, pushed: int) -> int:
        """How many of the `pushed` newest tokens it takes for `stop` to appear after what was sent."""
        before = len(self.tokens) - pushed
        for k in range(1, pushed):
            if self.decode(self.tokens[:before + k]).find(stop, self.sent) >= 0:
                return k
        return pushed

    def _stop_prefix(self, tail: str) -> int:
        """Length of the longest suffix of `tail` that begins some stop string."""
        best = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(tail)), best, -1):
                if stop.startswith(tail[len(tail) - n:]):
                    best = n
                    break
        return best
