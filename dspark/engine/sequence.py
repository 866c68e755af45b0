"""One request's state inside an engine: tokens so far, sampling settings, KV slot, status."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

import torch

from dspark.sampling import SamplingParams

_ids = itertools.count()


class FinishReason(str, Enum):
    STOP = "stop"  # an end-of-sequence or stop token
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"


@dataclass
class Sequence:
    prompt: list[int]
    params: SamplingParams
    req_id: str = field(default_factory=lambda: f"seq-{next(_ids)}")
    output: list[int] = field(default_factory=list)
    slot: int | None = None
    cached: int = 0  # tokens whose K/V are in the slot
    prefix_source: int | None = None  # the freed slot whose keys/values of its first `cached` tokens it reused
    finish: FinishReason | None = None
    generator: torch.Generator | None = None
    max_len: int | None = None  # context limit of the engine (prompt + output)
    captured: list = field(default_factory=list)  # (features, final hidden) per pass, when asked
    spec: object = None  # dspark.speculative.engine.SpecState under speculative decoding

    def __post_init__(self):
        if self.generator is None:
            self.generator = self.params.make_generator()
        self._tokens = self.prompt + self.output  # kept in step with output: O(1) per token

    @property
    def tokens(self) -> list[int]:
        """Prompt then output (the engine's own list: read it, do not change it)."""
        return self._tokens

    @property
    def done(self) -> bool:
        return self.finish is not None

    def pending(self) -> list[int]:
        """Tokens not yet in the KV cache (the whole prompt at first, then the last sampled token)."""
        return self.tokens[self.cached:]

    def append(self, token: int, eos_ids: tuple[int, ...]) -> None:
        """Add a decided token and set finish when a stop condition is met."""
        self.output.append(token)
        self._tokens.append(token)
        if token in eos_ids or token in self.params.stop_token_ids:
            self.finish = FinishReason.STOP
        elif len(self.output) >= self.params.max_tokens or self.max_len is not None and len(self.tokens) >= self.max_len:
            self.finish = FinishReason.LENGTH
