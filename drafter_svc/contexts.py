"""Apply one DraftRequest to a drafter: validate, release, roll back, extend, draft (plain functions).

A verifier's request ids live in their own namespace ("<stream>:<request id>"), so two verifiers
may use the same id and all contexts of a stream can be freed when it ends. A stream holds at
most `limits.max_contexts` contexts: past that the least recently used one is evicted (its
verifier gets context_missing and resends it), so a verifier that never releases cannot grow
the drafter without bound.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from dspark.drafters.base import DraftBlock, Drafter
from dspark.proto_gen.v1 import drafter_pb2
from dspark.wire import WireError, tensor_from_proto, tensor_to_proto

HIDDEN_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


@dataclass(frozen=True)
class Limits:
    vocab_size: int          # token ids must lie in [0, vocab_size)
    max_batch: int = 64      # sequences in one DraftRequest
    max_len: int = 1 << 20   # context positions of one sequence
    max_contexts: int = 128  # contexts one stream may hold (LRU eviction past it)


def context_key(stream: int, request_id: str) -> str:
    return f"{stream}:{request_id}"


def _check_ids(request_id: str, what: str, ids, vocab_size: int) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = min(ids) if min(ids) < 0 else max(ids)
        raise WireError(f"request {request_id!r}: {what} {bad} is outside the vocabulary [0, {vocab_size})")


def decode_updates(request: drafter_pb2.DraftRequest, width: int, limits: Limits,
                   drafts_ahead: bool = False) -> list[tuple]:
    """Check every sequence before anything changes; raises WireError (-> INVALID_ARGUMENT).

    Returns (update, hidden [n, width] or None) for each sequence that is not a release."""
    drafting = sum(1 for u in request.sequences if not u.release)
    if drafting > limits.max_batch or len(request.sequences) > limits.max_batch + limits.max_contexts:
        raise WireError(f"{drafting} sequences to draft ({len(request.sequences)} with releases) in one "
                        f"DraftRequest; at most {limits.max_batch} (+ {limits.max_contexts} releases)")
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
        _check_ids(update.request_id, "anchor_token", [update.anchor_token], limits.vocab_size)
        _check_ids(update.request_id, "context token", update.tokens, limits.vocab_size)
        if update.ahead and not drafts_ahead:
            raise WireError(f"request {update.request_id!r}: this drafter does not draft ahead (ahead={update.ahead})")
        if update.context_len + n + update.ahead > limits.max_len:
            raise WireError(f"request {update.request_id!r}: anchor at position {update.context_len + n + update.ahead}; "
                            f"at most {limits.max_len} positions")
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


def evict(drafter: Drafter, keys: OrderedDict, max_contexts: int, keep: set[str]) -> int:
    """Release the least recently used contexts beyond max_contexts (never one in `keep`)."""
    evicted = 0
    for key in list(keys):
        if len(keys) <= max_contexts:
            break
        if key in keep:
            continue
        drafter.release(key)
        del keys[key]
        evicted += 1
    return evicted


def draft_seed(seed: int, position: int) -> int:
    """A generator seed per (request seed, anchor position): replica- and history-independent."""
    return (seed * 1_000_003 + position) % (1 << 63)


@torch.inference_mode()
def answer(drafter: Drafter, stream: int, keys: OrderedDict, request: drafter_pb2.DraftRequest,
           width: int, limits: Limits) -> drafter_pb2.DraftResponse | None:
    """One DraftRequest -> one DraftResponse (None for a context push, which drafts nothing);
    `keys` tracks the stream's contexts, least recently used first."""
    updates = decode_updates(request, width, limits, drafter.drafts_ahead)
    for update in request.sequences:
        if update.release:
            key = context_key(stream, update.request_id)
            drafter.release(key)
            keys.pop(key, None)
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
        keys[key] = None
        keys.move_to_end(key)
        drafting.append(update)
    evict(drafter, keys, limits.max_contexts, keep={context_key(stream, u.request_id) for u in drafting})
    if request.context_only:
        return None
    blocks = {}
    if drafting:
        gens = [torch.Generator().manual_seed(draft_seed(u.seed, u.context_len + len(u.tokens) + u.ahead))
                if u.HasField("seed") else None for u in drafting]
        ahead = {"gaps": [u.ahead for u in drafting]} if any(u.ahead for u in drafting) else {}
        block = drafter.draft([context_key(stream, u.request_id) for u in drafting],
                              torch.tensor([u.anchor_token for u in drafting], dtype=torch.long),
                              torch.tensor([u.temperature for u in drafting], dtype=torch.float32), gens, **ahead)
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
