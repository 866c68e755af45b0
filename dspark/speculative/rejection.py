"""Chain rejection sampling over a flattened varlen batch: the torch reference.

Layout (R requests, request r verifies l_r = draft_lens[r] drafts, D = sum l_r):
  draft_tokens [D], support_ids / support_probs [D, S]   request 0's drafts, then request 1's, ...
  target_probs [D + R, V]   request r owns l_r + 1 rows: one per draft position, then the bonus.
  uniform_accept [D], uniform_residual [R]

Per request, draft x_j is accepted iff u_j * q_j(x_j) < p_j(x_j), i.e. u_j < p_j(x_j) / q_j(x_j)
written without a division (so q = 0 needs no special case). At the first rejection one token is
drawn from norm(max(0, p_j - q_j)) (from p_j if that has no mass); if every draft is accepted, the
bonus token is drawn from the last row. Both draws use inverse CDF with uniform_residual[r].

The Triton kernel in rejection_triton.py does the same fp32 operations (unnormalised weights,
threshold u * total, first index whose cumulative weight exceeds it); only the summation order
differs, so the two agree exactly whenever those sums are exact.
"""

import torch

from dspark.sampling import inverse_cdf, rand_from


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    support_ids: torch.Tensor,
    support_probs: torch.Tensor,
    draft_lens: torch.Tensor,
    uniform_accept: torch.Tensor,
    uniform_residual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (num_accepted [R] int64, output_tokens [R, max_len + 1] int64 padded with -1).

    Request r emits output_tokens[r, : num_accepted[r] + 1]: its accepted drafts, then one
    corrected or bonus token.
    """
    device = target_probs.device
    num_requests, num_drafts = draft_lens.numel(), draft_tokens.numel()
    lens = draft_lens.to(device=device, dtype=torch.int64)
    max_len = int(lens.max()) if num_requests else 0
    draft_starts = lens.cumsum(0) - lens
    request_of_draft = torch.repeat_interleave(torch.arange(num_requests, device=device), lens)
    slot_of_draft = torch.arange(num_drafts, device=device) - draft_starts[request_of_draft]

    # Acceptance test of every draft at once; each earlier request owns one extra (bonus) row.
    draft_rows = torch.arange(num_drafts, device=device) + request_of_draft
    p_draft = target_probs[draft_rows, draft_tokens].float()
    q_draft = torch.where(support_ids == draft_tokens[:, None], support_probs.float(), 0.0).sum(dim=-1)
    accepted = uniform_accept.to(device).float() * q_draft < p_draft

    # A request keeps its drafts up to the first rejection: cumprod over its slots.
    accepted_grid = torch.zeros(num_requests, max_len, dtype=torch.int64, device=device)
    accepted_grid[request_of_draft, slot_of_draft] = accepted.long()
    num_accepted = accepted_grid.cumprod(dim=1).sum(dim=1)

    # The last token: from max(0, p - q) at the first rejection (from p if that is empty),
    # from the bonus row p when every draft was accepted (q = 0 there).
    p = target_probs[draft_starts + torch.arange(num_requests, device=device) + num_accepted].float()
    q = torch.zeros_like(p)
    rejected = (num_accepted < lens).nonzero().squeeze(1)
    rejected_drafts = draft_starts[rejected] + num_accepted[rejected]
    q[rejected] = q[rejected].scatter_add(1, support_ids[rejected_drafts], support_probs[rejected_drafts].float())
    residual = (p - q).clamp(min=0)
    weights = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    last_tokens = inverse_cdf(weights, uniform_residual.to(device))

    output_tokens = torch.full((num_requests, max_len + 1), -1, dtype=torch.int64, device=device)
    output_tokens[request_of_draft, slot_of_draft] = draft_tokens.long()
    output_tokens[torch.arange(max_len + 1, device=device) >= num_accepted[:, None]] = -1
    output_tokens.scatter_(1, num_accepted[:, None], last_tokens[:, None])
    return num_accepted, output_tokens


def draw_uniforms(
    draft_lens: torch.Tensor | list[int], generators: list[torch.Generator | None],
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniform_accept [D], uniform_residual [R]) on `device`; request r's l_r + 1 uniforms come
    from its own (CPU) generator, so seeded draws are the same on every device."""
    lens = draft_lens.tolist() if isinstance(draft_lens, torch.Tensor) else list(draft_lens)
    if not lens:
        return torch.empty(0, device=device), torch.empty(0, device=device)
    per_request = [rand_from(g, int(n) + 1) for g, n in zip(generators, lens, strict=True)]
    # One host->device copy for all of them.
    both = torch.cat([u[:-1] for u in per_request] + [torch.stack([u[-1] for u in per_request])])
    both = both.to(device, non_blocking=True)
    return both[:-len(lens)], both[-len(lens):]


def greedy_verify(target_argmax: list[int], drafts: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """rejection_sample for a batch whose every target row is greedy (one-hot on its argmax), on the host.

    With p one-hot, u * q(x) < p(x) holds iff x is the argmax, whatever q and u are, and the residual
    (or the bonus row) is that one-hot again: the chain keeps the drafts that match the target's
    argmax and then emits the argmax. Same tokens as rejection_sample, without the vocabulary-wide
    softmax and one-hot rows. target_argmax: each request's l_r + 1 rows back to back.
    Returns (num_accepted [R], output tokens [R] of num_accepted + 1 each).
    """
    if len(target_argmax) != sum(len(d) + 1 for d in drafts):
        raise ValueError(f"{len(target_argmax)} target rows for {len(drafts)} requests' drafts and bonus positions")
    num_accepted, tokens, first = [], [], 0
    for draft in drafts:
        rows = target_argmax[first:first + len(draft) + 1]
        first += len(draft) + 1
        n = 0
        while n < len(draft) and draft[n] == rows[n]:
            n += 1
        num_accepted.append(n)
        tokens.append(list(draft[:n]) + [rows[n]])
    return num_accepted, tokens


def rejection_sample_auto(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    support_ids: torch.Tensor,
    support_probs: torch.Tensor,
    draft_lens: torch.Tensor,
    uniform_accept: torch.Tensor,
    uniform_residual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rejection_sample through the Triton kernel for CUDA tensors, the torch reference otherwise."""
    args = (target_probs, draft_tokens, support_ids, support_probs, draft_lens, uniform_accept, uniform_residual)
    if target_probs.is_cuda:
        from dspark.speculative.rejection_triton import rejection_sample_triton  # import triton only when used

        return rejection_sample_triton(*args)
    return rejection_sample(*args)
