"""Drafter training losses (method.md 3), plain functions on tensors.

Shapes: blocks are [A, g] (A anchors, g = gamma slots) with a trailing V' for distributions over
the draft vocabulary. The target distribution p^t over the full vocabulary V is given by its
restriction to the draft vocabulary `p_in [.., V']` and the mass outside it `mass_out [..]`
(zero without a draft vocabulary): the drafter puts no mass there, so that mass is all distance.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DEFAULT_MIX = {"ce": 0.1, "tv": 0.9, "conf": 1.0}


def slot_weights(gamma: int, decay: float = 4.0, device: torch.device | str = "cpu") -> torch.Tensor:
    """w_k = exp(-(k-1)/g) for k = 1..gamma."""
    return torch.exp(-torch.arange(gamma, dtype=torch.float32, device=device) / decay)


def weighted_mean(values: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(w_k v) / sum(w_k) over valid entries; weights broadcast over the last dim. 0 if none is valid."""
    w = weights.to(values.device) * valid.float()
    values = torch.where(valid, values, torch.zeros_like(values))  # whatever invalid rows hold stays out
    return (values * w).sum() / w.sum().clamp(min=1e-12)


def target_probs(target_logits: torch.Tensor, target_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p^t restricted to the draft vocab from its logits there and the full-vocabulary logsumexp.

    Returns (p_in [.., V'], mass_out [..] = 1 - sum p_in).
    """
    p_in = torch.exp(target_logits.float() - target_lse.float()[..., None])
    return p_in, (1.0 - p_in.sum(-1)).clamp(min=0.0)


def l1_distance(draft_logits: torch.Tensor, p_in: torch.Tensor, mass_out: torch.Tensor) -> torch.Tensor:
    """||p^d - p^t||_1 per row, counting the target mass outside the draft vocabulary."""
    return (torch.softmax(draft_logits.float(), -1) - p_in).abs().sum(-1) + mass_out


def acceptance(l1: torch.Tensor) -> torch.Tensor:
    """sum_v min(p^d, p^t) = 1 - ||p^d - p^t||_1 / 2: the chance a sampled draft token survives."""
    return 1.0 - 0.5 * l1


def token_cross_entropy(draft_logits: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """-log p^d(token) per row; token_index is the draft-vocab index, -1 (outside) gives 0."""
    logp = torch.log_softmax(draft_logits.float(), -1)
    picked = logp.gather(-1, token_index.clamp(min=0)[..., None]).squeeze(-1)
    return torch.where(token_index >= 0, -picked, torch.zeros_like(picked))


def confidence_bce(conf_logits: torch.Tensor, soft_labels: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(conf_logits.float(), soft_labels, reduction="none")


def dspark_loss(logits, conf_logits, p_in, mass_out, token_index, valid, weights, mix=DEFAULT_MIX) -> dict:
    """0.1 CE + 0.9 TV + 1.0 confidence BCE, each a w_k-weighted mean over valid slots.

    logits [A, g, V'] teacher-forced p^d logits; conf_logits [A, g] or None; token_index [A, g]
    the regenerated token's draft index (-1 outside: no CE); valid [A, g] bool.
    """
    l1 = l1_distance(logits, p_in, mass_out)
    ce = weighted_mean(token_cross_entropy(logits, token_index), valid & (token_index >= 0), weights)
    tv = weighted_mean(l1, valid, weights)
    total = mix["ce"] * ce + mix["tv"] * tv
    out = {"ce": ce, "tv": tv}
    if conf_logits is not None:
        labels = acceptance(l1).detach().clamp(0.0, 1.0)  # c*_k, a target, not a path for gradients
        out["conf"] = weighted_mean(confidence_bce(conf_logits, labels), valid, weights)
        total = total + mix["conf"] * out["conf"]
    out["loss"] = total
    out.update(slot_acceptance(l1.detach(), valid))
    return out


def dflash_loss(logits, p_in, mass_out, token_index, valid, weights) -> dict:
    """DFlash baseline: cross-entropy only (the distance is computed for the acceptance log)."""
    ce = weighted_mean(token_cross_entropy(logits, token_index), valid & (token_index >= 0), weights)
    out = {"loss": ce, "ce": ce}
    out.update(slot_acceptance(l1_distance(logits.detach(), p_in, mass_out), valid))
    return out


def eagle3_loss(logits, p_in, mass_out, step, num_steps: int, step_decay: float = 0.8) -> dict:
    """Training-time test: soft CE -sum_v p^t log p^d on unrolled step j rows, weighted step_decay^j.

    Flat rows (a sample of the valid (step, position) pairs): logits/p_in [N, V'], mass_out [N],
    step [N] the unrolled step (0-based) of each row.
    """
    soft_ce = -(p_in * torch.log_softmax(logits.float(), -1)).sum(-1)
    w = step_decay ** step.float()
    loss = (soft_ce * w).sum() / w.sum().clamp(min=1e-12)
    one_hot = F.one_hot(step, num_steps).bool()  # [N, steps] for the per-step log
    l1 = l1_distance(logits.detach(), p_in, mass_out)
    out = {"loss": loss, "soft_ce": loss}
    out.update(slot_acceptance(l1[:, None].expand(-1, num_steps), one_hot))
    return out


def slot_acceptance(l1: torch.Tensor, valid: torch.Tensor) -> dict:
    """Teacher-forced acceptance proxy per slot (mean of 1 - l1/2 over valid rows), for the log."""
    with torch.no_grad():
        alpha = acceptance(l1) * valid
        count = valid.float().sum(0)
        per_slot = (alpha.sum(0) / count.clamp(min=1)).tolist()
        per_slot = [a if c > 0 else math.nan for a, c in zip(per_slot, count.tolist())]
    return {"accept": per_slot}
