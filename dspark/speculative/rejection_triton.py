"""Chain rejection sampling as one Triton kernel: one program per request.

Same inputs, outputs and arithmetic as the torch reference `rejection.rejection_sample` (see its
docstring for the layout). Each program walks its request's drafts (acceptance test), then draws
the corrected or bonus token by inverse CDF over the vocabulary in blocks of BLOCK_V:
pass 1 sums the weights, pass 2 finds the first index whose running sum exceeds u * total.
Runs on CPU under TRITON_INTERPRET=1 (set before this module is imported).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _chain_rejection_kernel(
    target_probs_ptr,
    draft_tokens_ptr,
    support_ids_ptr,
    support_probs_ptr,
    draft_starts_ptr,
    draft_lens_ptr,
    uniform_accept_ptr,
    uniform_residual_ptr,
    num_accepted_ptr,
    output_tokens_ptr,
    vocab_size,
    support_size,
    target_stride,
    support_stride,
    output_stride,
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    r = tl.program_id(0)
    draft_start = tl.load(draft_starts_ptr + r)
    length = tl.load(draft_lens_ptr + r)
    row_start = draft_start + r  # each earlier request also owns one bonus row
    output_row = output_tokens_ptr + r * output_stride
    s_offs = tl.arange(0, BLOCK_S)
    s_mask = s_offs < support_size

    # Acceptance: draft j survives iff all drafts before it did and u_j * q_j(x_j) < p_j(x_j).
    accepted = length * 0
    for j in range(0, length):
        d = draft_start + j
        token = tl.load(draft_tokens_ptr + d)
        p_token = tl.load(target_probs_ptr + (row_start + j) * target_stride + token).to(tl.float32)
        ids = tl.load(support_ids_ptr + d * support_stride + s_offs, mask=s_mask, other=-1)
        qs = tl.load(support_probs_ptr + d * support_stride + s_offs, mask=s_mask, other=0.0).to(tl.float32)
        q_token = tl.sum(tl.where(ids == token, qs, 0.0), axis=0)
        u = tl.load(uniform_accept_ptr + d)
        survives = (accepted == j) & (u * q_token < p_token)
        tl.store(output_row + j, token, mask=survives)
        accepted += survives.to(accepted.dtype)

    # Corrected token at the first rejection, or the bonus token: its row, and the draft support
    # to subtract. The bonus row loads no support (ids = -1 matches no token, so q = 0).
    row_ptr = target_probs_ptr + (row_start + accepted) * target_stride
    d = draft_start + accepted
    s_mask = s_offs < tl.where(accepted < length, support_size, 0)
    ids = tl.load(support_ids_ptr + d * support_stride + s_offs, mask=s_mask, other=-1)
    qs = tl.load(support_probs_ptr + d * support_stride + s_offs, mask=s_mask, other=0.0).to(tl.float32)

    # Pass 1: the mass of max(0, p - q) and of p.
    residual_mass = 0.0
    p_mass = 0.0
    for v0 in range(0, vocab_size, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        p = tl.load(row_ptr + offs, mask=offs < vocab_size, other=0.0).to(tl.float32)
        q = tl.sum(tl.where(offs[:, None] == ids[None, :], qs[None, :], 0.0), axis=1)
        residual_mass += tl.sum(tl.maximum(p - q, 0.0), axis=0)
        p_mass += tl.sum(p, axis=0)
    # An empty residual falls back to p itself: drop q.
    ids = tl.where(residual_mass > 0, ids, -1)
    total = tl.where(residual_mass > 0, residual_mass, p_mass)
    threshold = tl.load(uniform_residual_ptr + r) * total

    # Pass 2: the first index whose cumulative weight exceeds the threshold.
    chosen = vocab_size
    last_positive = -1
    running = 0.0
    for v0 in range(0, vocab_size, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        in_vocab = offs < vocab_size
        p = tl.load(row_ptr + offs, mask=in_vocab, other=0.0).to(tl.float32)
        q = tl.sum(tl.where(offs[:, None] == ids[None, :], qs[None, :], 0.0), axis=1)
        weights = tl.maximum(p - q, 0.0)
        cumulative = running + tl.cumsum(weights, axis=0)
        chosen = tl.minimum(chosen, tl.min(tl.where(in_vocab & (cumulative > threshold), offs, vocab_size), axis=0))
        last_positive = tl.maximum(last_positive, tl.max(tl.where(weights > 0, offs, -1), axis=0))
        running += tl.sum(weights, axis=0)
    # Rounding can put the threshold on the total itself; then take the last positive weight.
    chosen = tl.where(chosen < vocab_size, chosen, tl.maximum(last_positive, 0))

    tl.store(output_row + accepted, chosen.to(tl.int64))
    tl.store(num_accepted_ptr + r, accepted.to(tl.int64))


def rejection_sample_triton(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    support_ids: torch.Tensor,
    support_probs: torch.Tensor,
    draft_lens: torch.Tensor,
    uniform_accept: torch.Tensor,
    uniform_residual: torch.Tensor,
    block_v: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rejection.rejection_sample; `block_v` is the vocabulary tile (a power of 2)."""
    device = target_probs.device
    num_requests = draft_lens.numel()
    draft_lens = draft_lens.to(device=device, dtype=torch.int64)
    max_len = int(draft_lens.max()) if num_requests else 0  # the output width needs it on the host
    num_accepted = torch.zeros(num_requests, dtype=torch.int64, device=device)
    output_tokens = torch.full((num_requests, max_len + 1), -1, dtype=torch.int64, device=device)
    if num_requests == 0:
        return num_accepted, output_tokens

    vocab_size = target_probs.shape[1]
    support_size = support_ids.shape[1]
    target_probs = target_probs.contiguous()
    support_ids = support_ids.to(device=device, dtype=torch.int64).contiguous()
    support_probs = support_probs.to(device).contiguous()
    _chain_rejection_kernel[(num_requests,)](
        target_probs,
        draft_tokens.to(device=device, dtype=torch.int64).contiguous(),
        support_ids,
        support_probs,
        torch.cumsum(draft_lens, 0) - draft_lens,
        draft_lens,
        uniform_accept.to(device=device, dtype=torch.float32).contiguous(),
        uniform_residual.to(device=device, dtype=torch.float32).contiguous(),
        num_accepted,
        output_tokens,
        vocab_size,
        support_size,
        target_probs.stride(0),
        support_ids.stride(0),
        output_tokens.stride(0),
        BLOCK_V=min(block_v, triton.next_power_of_2(vocab_size)),
        BLOCK_S=triton.next_power_of_2(max(support_size, 1)),
        enable_fp_fusion=False,  # no fused multiply-adds: round exactly like the torch reference
    )
    return num_accepted, output_tokens
