"""Which draft blocks a sequence is trained on, and which of their slots are supervised.

A block at anchor a predicts the tokens at a+1..a+gamma (slot k -> a+k). Slot k is supervised
only while every slot <= k is a response token inside the sequence: after the first slot that
is not, the block's prefix would already have been rejected (method.md 3).
"""
from __future__ import annotations

import torch


def slot_validity(anchors: torch.Tensor, loss_mask: torch.Tensor, gamma: int) -> torch.Tensor:
    """[A, gamma] bool: slot k of the block at anchors[i] is supervised."""
    length = loss_mask.shape[0]
    targets = anchors[:, None] + torch.arange(1, gamma + 1, device=anchors.device)  # the position slot k predicts
    inside = targets < length
    is_response = loss_mask.bool()[targets.clamp(max=length - 1)] & inside
    return is_response.int().cumprod(dim=1).bool()  # valid while all earlier slots are


def candidate_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """Anchors whose block has at least one supervised slot: the token at a+1 is a response token."""
    mask = loss_mask.bool()
    return torch.nonzero(mask[1:]).squeeze(1)  # a = p - 1 for every response position p >= 1


def sample_anchors(loss_mask: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `count` distinct anchors drawn uniformly from the candidates, sorted."""
    candidates = candidate_anchors(loss_mask)
    if candidates.numel() > count:
        pick = torch.randperm(candidates.numel(), generator=generator)[:count]  # the host generator's draw
        candidates = candidates[pick.to(candidates.device)]
    return candidates.sort().values


def ttt_validity(loss_mask: torch.Tensor, num_steps: int) -> torch.Tensor:
    """EAGLE-3 unrolled rows [num_steps, L-1]: step j at position p predicts the token at p+2;
    supervised when p >= j (its chain starts inside the sequence) and that token is a response token."""
    length = loss_mask.shape[0]
    p = torch.arange(length - 1, device=loss_mask.device)
    predicted = p + 2
    response = loss_mask.bool()[predicted.clamp(max=length - 1)] & (predicted < length)
    return (p[None, :] >= torch.arange(num_steps, device=loss_mask.device)[:, None]) & response[None, :]


def sample_rows(valid: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `count` of the True entries of `valid` as flat indices, drawn uniformly, sorted."""
    rows = torch.nonzero(valid.reshape(-1)).squeeze(1)
    if rows.numel() > count:
        pick = torch.randperm(rows.numel(), generator=generator)[:count]  # the host generator's draw
        rows = rows[pick.to(rows.device)].sort().values
    return rows
