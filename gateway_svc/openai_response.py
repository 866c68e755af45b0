"""OpenAI response JSON (whole responses and stream chunks) from plain values; SSE framing."""
from __future__ import annotations

import json
import uuid

from dspark_client import FinishReason

OBJECT = {"chat": "chat.completion", "completion": "text_completion"}
CHUNK_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}
ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-"}
DONE = b"data: [DONE]\n\n"


def new_id(kind: str) -> str:
    return ID_PREFIX[kind] + uuid.uuid4().hex


def finish_reason(reason: FinishReason | None) -> str | None:
    """OpenAI knows "stop" and "length"; errors are reported as errors, not as a finish reason."""
    return {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(reason)


def _choice(kind: str, index: int, text: str, finish: str | None, streaming: bool, first: bool = False) -> dict:
    if kind == "completion":
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
    if streaming:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
    return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
            "logprobs": None}


def response(kind: str, id: str, created: int, model: str, choices: list[tuple[str, str | None]],
             usage: dict) -> dict:
    """A whole (non-streamed) response; choices: (text, finish_reason) in index order."""
    return {"id": id, "object": OBJECT[kind], "created": created, "model": model,
            "choices": [_choice(kind, i, text, finish, False) for i, (text, finish) in enumerate(choices)],
            "usage": usage}


def chunk(kind: str, id: str, created: int, model: str, index: int, text: str, finish: str | None,
          first: bool, include_usage: bool) -> dict:
    """One stream chunk carrying one choice's delta. With include_usage every chunk has usage: null
    and a last chunk (usage_chunk) carries the totals, as OpenAI streams it."""
    out = {"id": id, "object": CHUNK_OBJECT[kind], "created": created, "model": model,
           "choices": [_choice(kind, index, text, finish, True, first)]}
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(kind: str, id: str, created: int, model: str, usage: dict) -> dict:
    return {"id": id, "object": CHUNK_OBJECT[kind], "created": created, "model": model, "choices": [],
            "usage": usage}


def sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def model_list(models, created: int = 0) -> dict:
    """models: dspark ModelInfo messages (name, drafter, gamma, max_context_tokens)."""
    return {"object": "list", "data": [
        {"id": m.name, "object": "model", "created": created, "owned_by": "dspark",
         "max_model_len": m.max_context_tokens, "drafter": m.drafter or None, "gamma": m.gamma}
        for m in models]}
