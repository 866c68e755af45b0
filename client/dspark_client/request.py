"""Build a GenerateRequest from plain Python arguments."""

from collections.abc import Sequence

from .proto_gen.v1 import generation_pb2 as pb
from .types import ChatMessage, Message


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[Message] | None = None,
    token_ids: Sequence[int] | None = None,
    model: str = "",
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    max_tokens: int = 0,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    speculation: bool = True,
    max_draft_tokens: int = 0,
    request_id: str = "",
    stream_interval_ms: int = 0,
) -> pb.GenerateRequest:
    """Exactly one of prompt / messages / token_ids. Zeros mean "server default" or "off"
    as generation.proto documents (temperature 0 = greedy, top_k 0 = no top-k; stream_interval_ms
    0 = a chunk every engine step)."""
    given = [name for name, value in (("prompt", prompt), ("messages", messages), ("token_ids", token_ids))
             if value is not None]
    if len(given) != 1:
        raise ValueError(f"pass exactly one of prompt, messages, token_ids (got {given or 'none'})")
    if isinstance(stop, str):
        stop = [stop]  # a lone string would otherwise become one stop string per character
    request = pb.GenerateRequest(
        request_id=request_id,
        model=model,
        sampling=pb.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed),
        max_tokens=max_tokens,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        speculation=pb.SpeculationOverride(disable=not speculation, max_draft_tokens=max_draft_tokens),
        stream_interval_ms=stream_interval_ms,
    )
    if prompt is not None:
        request.text = prompt
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    else:
        request.messages.SetInParent()  # an empty conversation is still the "messages" variant
        for m in messages:
            m = m if isinstance(m, ChatMessage) else ChatMessage(m["role"], m["content"])
            request.messages.messages.add(role=m.role, content=m.content)
    return request


# generate() reads the whole answer, so its stream need not carry every step: tokens come in
# chunks at most this often (the first at once), which saves each hop its per-chunk work.
COLLECTED_STREAM_INTERVAL_MS = 500


class Received:
    """What a stream has delivered so far, and the request that resumes after it."""

    def __init__(self):
        self.token_ids: list[int] = []
        self.text: list[str] = []

    def add(self, chunk: pb.GenerateChunk) -> None:
        self.token_ids.extend(chunk.token_ids)
        self.text.append(chunk.text)

    def resume(self, request: pb.GenerateRequest) -> pb.GenerateRequest:
        if not self.token_ids:
            return request
        resumed = pb.GenerateRequest()
        resumed.CopyFrom(request)
        resumed.resume.streamed_token_ids[:] = self.token_ids
        resumed.resume.streamed_text = "".join(self.text)
        return resumed
