"""Plain Python views of the wire messages, so callers never touch protobuf."""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

from .proto_gen.v1 import generation_pb2 as pb


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    ERROR = "error"
    CANCELLED = "cancelled"


_FINISH = {
    pb.FINISH_REASON_STOP: FinishReason.STOP,
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_ERROR: FinishReason.ERROR,
    pb.FINISH_REASON_CANCELLED: FinishReason.CANCELLED,
}


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


Message = ChatMessage | Mapping[str, str]


@dataclass(frozen=True)
class SpecMetrics:
    """Speculative decoding counters of one request (see generation.proto SpecMetrics)."""

    prompt_tokens: int
    generated_tokens: int
    steps: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    tau: float  # acceptance length: tokens per target step, bonus token included
    verified_per_position: tuple[int, ...]
    accepted_per_position: tuple[int, ...]

    @classmethod
    def from_proto(cls, m: pb.SpecMetrics) -> "SpecMetrics":
        return cls(
            prompt_tokens=m.prompt_tokens,
            generated_tokens=m.generated_tokens,
            steps=m.steps,
            drafts=m.drafts,
            draft_tokens=m.draft_tokens,
            accepted_tokens=m.accepted_tokens,
            tau=m.tau,
            verified_per_position=tuple(m.verified_per_position),
            accepted_per_position=tuple(m.accepted_per_position),
        )


@dataclass(frozen=True)
class Chunk:
    """One streamed step: the tokens decided in it and their text."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    offset: int  # tokens streamed before this chunk
    finish_reason: FinishReason | None  # None until the last chunk
    error: str
    metrics: SpecMetrics | None

    @classmethod
    def from_proto(cls, c: pb.GenerateChunk) -> "Chunk":
        return cls(
            request_id=c.request_id,
            token_ids=tuple(c.token_ids),
            text=c.text,
            offset=c.offset,
            finish_reason=_FINISH.get(c.finish_reason),
            error=c.error,
            metrics=SpecMetrics.from_proto(c.metrics) if c.HasField("metrics") else None,
        )


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None  # None only if the server closed without saying why
    error: str
    metrics: SpecMetrics | None


def collect(chunks: Iterable[Chunk]) -> GenerationResult:
    """Join a finished stream into one result (the last metrics seen are the totals)."""
    text, tokens = [], []
    request_id, finish, error, metrics = "", None, "", None
    for chunk in chunks:
        text.append(chunk.text)
        tokens.extend(chunk.token_ids)
        request_id = chunk.request_id or request_id
        finish = chunk.finish_reason or finish
        error = chunk.error or error
        metrics = chunk.metrics or metrics
    return GenerationResult(request_id, "".join(text), tuple(tokens), finish, error, metrics)
