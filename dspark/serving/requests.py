"""Checks on a public GenerateRequest and its translation to SamplingParams (plain functions).

Status codes: INVALID_ARGUMENT for a malformed value, OUT_OF_RANGE for a prompt that does not
fit the context, NOT_FOUND for a model nobody serves. The scheduler runs the checks it can
without a tokenizer; the verifier runs all of them.
"""
from __future__ import annotations

import math

import grpc

from dspark.proto_gen.v1 import generation_pb2 as pb
from dspark.sampling import SamplingParams

ROLES = ("system", "user", "assistant")


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def check_request(request: pb.GenerateRequest, models: set[str] | None = None) -> None:
    """Everything checkable without the model. `models`: names served (None = unknown, skip)."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise invalid("the request has no prompt (set text, token_ids or messages)")
    if kind == "text" and not request.text:
        raise invalid("prompt is empty")
    if kind == "token_ids":
        if not request.token_ids.ids:
            raise invalid("prompt is empty")
        if min(request.token_ids.ids) < 0:
            raise invalid("token ids must be >= 0")
    if request.stop_token_ids and min(request.stop_token_ids) < 0:
        raise invalid("stop_token_ids must be >= 0")
    if request.resume.streamed_token_ids and min(request.resume.streamed_token_ids) < 0:
        raise invalid("resume.streamed_token_ids must be >= 0")
    if kind == "messages":
        if not request.messages.messages:
            raise invalid("prompt is empty (no messages)")
        bad = [m.role for m in request.messages.messages if m.role not in ROLES]
        if bad:
            raise invalid(f"message role must be one of {ROLES}, got {bad[0]!r}")
    s = request.sampling
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise invalid(f"temperature must be >= 0 (0 = greedy), got {s.temperature}")
    # top_p 0 is the proto3 default, i.e. "not set" (generation.proto); otherwise it must lie in (0, 1].
    if not math.isfinite(s.top_p) or s.top_p < 0 or s.top_p > 1:
        raise invalid(f"top_p must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise invalid(f"top_k must be >= 0 (0 = off), got {s.top_k}")
    if any(not stop for stop in request.stop):
        raise invalid("stop strings must not be empty")
    if models is not None and request.model and request.model not in models:
        raise RequestError(grpc.StatusCode.NOT_FOUND,
                           f"model {request.model!r} is not served here (available: {sorted(models)})")


def check_prompt_fits(prompt_len: int, max_len: int) -> None:
    if prompt_len >= max_len:
        raise RequestError(grpc.StatusCode.OUT_OF_RANGE,
                           f"prompt of {prompt_len} tokens does not fit the context of {max_len} tokens "
                           f"(at least one must be left to generate)")


def check_token_ids(ids, vocab_size: int, what: str = "token id") -> None:
    """Every id in [0, vocab_size): anything else would index past the embedding."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = min(ids) if min(ids) < 0 else max(ids)
        raise invalid(f"{what} {bad} is outside the vocabulary [0, {vocab_size})")


def check_max_tokens(max_tokens: int, cap: int) -> None:
    if max_tokens > cap:
        raise invalid(f"max_tokens {max_tokens} is above this server's cap of {cap}")


def sampling_params(request: pb.GenerateRequest, default_max_tokens: int) -> SamplingParams:
    s = request.sampling
    return SamplingParams(
        temperature=float(s.temperature), top_p=float(s.top_p) if 0 < s.top_p <= 1 else 1.0, top_k=int(s.top_k),
        seed=int(s.seed) if s.HasField("seed") else None,
        max_tokens=int(request.max_tokens) or default_max_tokens,
        stop_token_ids=tuple(int(t) for t in request.stop_token_ids))
