"""Sampling parameters, logits -> probabilities, seeded sampling and the compact exact draft q.

Every sampler here draws its randomness as uniforms from one generator per row and turns
them into tokens by inverse CDF, so a request with a seed is reproducible no matter which
other requests share its batch.
"""

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")

    def make_generator(self) -> torch.Generator | None:
        """A CPU generator seeded from `seed`, or None to use the global RNG."""
        if self.seed is None:
            return None
        return torch.Generator().manual_seed(self.seed)


def rand_from(generator: torch.Generator | None, n: int) -> torch.Tensor:
    """`n` uniforms in [0, 1) (float32, CPU) from `generator`, or the global CPU RNG when None.

    Uniforms always come from a CPU generator, whatever device the model runs on, so a seeded
    request replays the same draws on CPU and GPU; callers copy them to the model's device."""
    generator = torch.default_generator if generator is None else generator
    return torch.rand(n, generator=generator, device=generator.device).cpu()


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index per row of `weights [N, K]` (non-negative, need not sum to 1) chosen by `uniforms [N]`.

    Picks the first index whose cumulative weight exceeds u * total, which is always an index
    with positive weight. Rows with zero total give index 0.
    """
    cumulative = weights.float().cumsum(dim=-1)
    threshold = uniforms.to(cumulative.device, non_blocking=True).float() * cumulative[:, -1]
    exceeds = cumulative > threshold[:, None]
    # Rounding can put the threshold on the total itself; then take the last positive weight.
    last_positive = _last_true(weights > 0)
    first_exceeding = torch.where(exceeds.any(dim=-1), exceeds.int().argmax(dim=-1), last_positive)
    return first_exceeding.clamp(min=0)


def _last_true(mask: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask, positions, -1).amax(dim=-1)


def logits_to_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Per-row temperature, then top-k, then top-p (nucleus), renormalised. Returns float32 [N, V].

    Rows with temperature 0 become one-hot on the argmax (lowest index on ties).
    """
    logits = logits.float()
    temperature = temperature.to(logits.device).float()
    top_k = top_k.to(logits.device).long()
    top_p = top_p.to(logits.device).float()
    greedy = temperature <= 0

    safe_temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / safe_temperature[:, None], dim=-1)
    # Only rows that truncate need the (V log V) sort; plain and greedy rows skip it.
    truncate = ~greedy & ((top_k > 0) | (top_p < 1))
    if truncate.any():
        rows = truncate.nonzero().squeeze(1)
        probs[rows] = _top_k_top_p(probs[rows], top_k[rows], top_p[rows])
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # Work in descending order; a stable sort keeps the lower index first among ties.
    sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)
    keep_sorted = (top_k[:, None] == 0) | (rank[None, :] < top_k[:, None])
    after_top_k = sorted_probs * keep_sorted
    # Nucleus on the top-k distribution: keep a token while the mass strictly before it is
    # below top_p of the total; the first token is always kept.
    mass_before = after_top_k.cumsum(dim=-1) - after_top_k
    keep_sorted &= mass_before < top_p[:, None] * after_top_k.sum(dim=-1, keepdim=True)
    keep = torch.zeros_like(keep_sorted).scatter_(1, sorted_ids, keep_sorted)
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs [N, V]`, row i driven by `generators[i]`. One-hot rows give the argmax."""
    if not generators:
        return torch.empty(0, dtype=torch.long, device=probs.device)
    return inverse_cdf(probs, torch.cat([rand_from(g, 1) for g in generators]))


def truncated_draft_distribution(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    support_size: int,
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafter's compact exact q: the top-S tokens of softmax(logits / T), renormalised.

    Returns (tokens [N], support_ids [N, S], support_probs [N, S]); each token is sampled from
    exactly its row's support distribution, which is what verification will divide by.
    Temperature-0 rows have a support of one token (the argmax, prob 1), zero-padded.
    """
    num_rows, vocab_size = logits.shape
    if not 1 <= support_size <= vocab_size:
        raise ValueError(f"support_size must be in [1, {vocab_size}], got {support_size}")
    logits = logits.float()
    temperature = temperature.to(logits.device).float()
    greedy = temperature <= 0

    safe_temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
    # top-S of softmax(logits / T), renormalised = softmax over the S largest logits / T.
    top_logits, support_ids = torch.topk(logits, support_size, dim=-1)
    support_probs = torch.softmax(top_logits / safe_temperature[:, None], dim=-1)

    # Greedy rows: the argmax of the raw logits (lowest index on ties) with prob 1, then zeros.
    is_first = torch.arange(support_size, device=logits.device)[None, :] == 0
    greedy_ids = torch.where(is_first, logits.argmax(dim=-1, keepdim=True), 0)
    support_ids = torch.where(greedy[:, None], greedy_ids, support_ids)
    support_probs = torch.where(greedy[:, None], is_first.float(), support_probs)

    picked = sample_from_probs(support_probs, generators).to(logits.device)
    tokens = support_ids.gather(1, picked[:, None]).squeeze(1)
    return tokens, support_ids, support_probs
