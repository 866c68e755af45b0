"""Apply one DraftRequest to a drafter: validate, release, roll back, extend, draft (plain functions).

A verifier's request ids live in their own namespace ("<stream>:<request id>"), so two verifiers
may use the same id and all contexts of a stream can be freed when it ends.
"""
from __future__ import annotations

import math

import torch

from dspark.drafters.base import DraftBlock, Drafter
from dspark.proto_gen.v1 import drafter_pb2
from dspark.wire import WireError, tensor_from_proto, tensor_to_proto

HIDDEN_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def context_key(stream: int, request_id: str) -> str:
    return f"{stream}:{request_id}"


def decode_updates(request: drafter_pb2.DraftRequest, width: int) -> list[tuple]:
    """Check every sequence before anything changes; raises WireError (-> INVALID_ARGUMENT).

    Returns (update, hidden [n, width] or None) for each sequence that is not a release."""
    seen, out = set(), []
    for update in request.sequences:
        if not update.request_id:
            raise WireError("sequence without request_id")
        if update.request_id in seen:
            raise WireError(f"request {update.request_id!r} appears twice in one DraftRequest")
        seen.add(update.request_id)
        if update.release:
            continue
        if not math.isfinite(update.temperature) or update.temperature < 0:
            raise WireError(f"request {update.request_id!r}: temperature must be >= 0, got {update.temperature}")
        n = len(update.tokens)
        hidden = None
        if n or update.HasField("hidden"):
            hidden = tensor_from_proto(update.hidden, expected_shape=(n, width))
            if hidden.dtype not in HIDDEN_DTYPES:
                raise WireError(f"request {update.request_id!r}: hidden rows must be bf16/f16/f32, got {hidden.dtype}")
        out.append((update, hidden))
    return out


def block_to_host(block: DraftBlock) -> DraftBlock:
    return DraftBlock(*(None if t is None else t.cpu() for t in (block.tokens, block.conf_logits, block.support_ids,
                                                                 block.support_probs, block.logits)))


def draft_seed(seed: int, position: int) -> int:
    """A generator seed per (request seed, anchor position): replica- and history-independent."""
    return (seed * 1_000_003 + position) % (1 << 63)


@torch.inference_mode()
def answer(drafter: Drafter, stream: int, keys: set[str], request: drafter_pb2.DraftRequest,
           width: int) -> drafter_pb2.DraftResponse:
    """One DraftRequest -> one DraftResponse; `keys` tracks the stream's contexts."""
    updates = decode_updates(request, width)
    for update in request.sequences:
        if update.release:
            key = context_key(stream, update.request_id)
            drafter.release(key)
            keys.discard(key)
    missing, drafting = set(), []
    for update, hidden in updates:
        key = context_key(stream, update.request_id)
        have = drafter.context_len(key)
        n = len(update.tokens)
        # The verifier believes we hold more than we do (we restarted, or lost it): ask for all of it.
        if update.context_len > have or update.context_len + n == 0:
            missing.add(update.request_id)
            continue
        drafter.rollback(key, update.context_len)
        if n:
            drafter.extend_context(key, hidden, torch.tensor(list(update.tokens), dtype=torch.long))  # to its device there
        keys.add(key)
        drafting.append(update)
    blocks = {}
    if drafting:
        gens = [torch.Generator().manual_seed(draft_seed(u.seed, u.context_len + len(u.tokens)))
                if u.HasField("seed") else None for u in drafting]
        block = drafter.draft([context_key(stream, u.request_id) for u in drafting],
                              torch.tensor([u.anchor_token for u in drafting], dtype=torch.long),
                              torch.tensor([u.temperature for u in drafting], dtype=torch.float32), gens)
        block = block_to_host(block)  # off the drafter's device in one go, onto the wire
        for i, u in enumerate(drafting):
            blocks[u.request_id] = drafter_pb2.SequenceDraft(
                request_id=u.request_id, tokens=block.tokens[i].tolist(),
                confidence_logits=tensor_to_proto(block.conf_logits[i].float()) if block.conf_logits is not None else None,
                support_ids=tensor_to_proto(block.support_ids[i].long()),
                support_probs=tensor_to_proto(block.support_probs[i].float()))
    response = drafter_pb2.DraftResponse(step=request.step)
    for update, _ in updates:
        if update.request_id in missing:
            response.sequences.add(request_id=update.request_id, context_missing=True)
        else:
            response.sequences.append(blocks[update.request_id])
    return response
