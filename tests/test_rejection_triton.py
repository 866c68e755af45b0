"""The Triton kernel against the torch reference, on CPU through the Triton interpreter.

TRITON_INTERPRET=1 must be set before any kernel is defined, so the comparison runs in a fresh
interpreter (this file run as a script) and the rest of the test session is unaffected.

Exactness: both sides do the same fp32 operations except summation order (the kernel sums the
vocabulary in tiles, torch in its own order). Targets and draft supports are therefore multiples of
1/256 (sums of them are exact in fp32 whatever the order), which makes the check exact. A second
batch with ordinary softmax floats checks num_accepted exactly (the acceptance test has no sums)
and allows at most one differing sampled token: a threshold u * total would have to land within
an ulp of a cumulative sum for the order to matter.
"""

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_triton_kernel_matches_reference_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "batches compared: 6" in result.stdout


def random_batch(seed: int, vocab: int = 50, support: int = 4, dyadic: bool = True):
    """A varlen batch with zero-length requests and a mix of greedy and sampled requests."""
    gen = torch.Generator().manual_seed(seed)
    num_requests = 10
    lens = torch.randint(0, 6, (num_requests,), generator=gen)
    lens[seed % num_requests] = 0
    greedy = torch.rand(num_requests, generator=gen) < 0.3

    target_rows, draft_tokens, support_ids, support_probs = [], [], [], []
    for r in range(num_requests):
        is_greedy, length = bool(greedy[r]), int(lens[r])
        logits = 3 * torch.randn(length + 1, vocab, generator=gen)
        target_rows.append(_as_probs(logits, is_greedy, dyadic, gen))
        # The draft sees the target's logits plus noise, so some drafts survive and some do not.
        draft_logits = logits[:length] + torch.randn(length, vocab, generator=gen)
        ids = draft_logits.topk(support, dim=-1).indices
        probs = _as_probs(draft_logits.gather(1, ids), is_greedy, dyadic, gen)
        draft_tokens.append(ids.gather(1, torch.multinomial(probs, 1, generator=gen)).squeeze(1))
        support_ids.append(ids)
        support_probs.append(probs)

    generators = [torch.Generator().manual_seed(seed * 100 + r) for r in range(num_requests)]
    from dspark.speculative.rejection import draw_uniforms

    return (
        torch.cat(target_rows),
        torch.cat(draft_tokens),
        torch.cat(support_ids),
        torch.cat(support_probs),
        lens,
        *draw_uniforms(lens, generators),
    )


def _as_probs(logits, greedy, dyadic, gen):
    """Rows of probabilities: one-hot (greedy), multiples of 1/256 (dyadic) or softmax floats."""
    if logits.shape[0] == 0:
        return torch.zeros(logits.shape)
    if greedy:
        return torch.zeros(logits.shape).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    probs = torch.softmax(logits, dim=-1)
    if not dyadic:
        return probs
    draws = torch.multinomial(probs, 256, replacement=True, generator=gen)
    return torch.stack([torch.bincount(row, minlength=logits.shape[1]) for row in draws]).float() / 256


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through the test: needs TRITON_INTERPRET=1"
    from dspark.speculative.rejection import rejection_sample
    from dspark.speculative.rejection_triton import rejection_sample_triton

    batches = 0
    for seed in range(4):
        inputs = random_batch(seed)
        want_accepted, want_tokens = rejection_sample(*inputs)
        got_accepted, got_tokens = rejection_sample_triton(*inputs, block_v=16)  # 4 tiles, last one partial
        assert torch.equal(got_accepted, want_accepted), (seed, got_accepted, want_accepted)
        assert torch.equal(got_tokens, want_tokens), (seed, got_tokens, want_tokens)
        assert 0 < want_accepted.sum() < inputs[4].sum(), "the batch should mix accepts and rejects"
        batches += 1

    # Hand-made: an empty residual (q dominates p, so the token comes from p), a zero-length
    # request, and a plain residual draw; then a batch with no requests at all.
    for u_residual in (0.1, 0.5, 0.9):
        target = torch.tensor(
            [[0.25, 0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.5, 0.0, 0.5], [0.5, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
        )
        inputs = (
            target,
            torch.tensor([0, 0]),
            torch.tensor([[0, 1, 2], [0, 3, 3]]),
            torch.tensor([[0.5, 0.5, 0.25], [1.0, 0.0, 0.0]]),
            torch.tensor([1, 0, 1]),
            torch.tensor([0.9, 0.7]),
            torch.full((3,), u_residual),
        )
        want, got = rejection_sample(*inputs), rejection_sample_triton(*inputs)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), (want, got)
    no_ids = torch.zeros(0, dtype=torch.int64)
    empty = (torch.zeros(0, 4), no_ids, no_ids.view(0, 2), torch.zeros(0, 2), no_ids, torch.zeros(0), torch.zeros(0))
    got_accepted, got_tokens = rejection_sample_triton(*empty)
    assert got_accepted.shape == (0,) and got_tokens.shape == (0, 1)

    for seed in (10, 11):
        inputs = random_batch(seed, dyadic=False)
        want_accepted, want_tokens = rejection_sample(*inputs)
        got_accepted, got_tokens = rejection_sample_triton(*inputs, block_v=16)
        assert torch.equal(got_accepted, want_accepted), (seed, got_accepted, want_accepted)
        differing_requests = (got_tokens != want_tokens).any(dim=1).sum()
        assert differing_requests <= 1, (seed, got_tokens, want_tokens)
        batches += 1
    print(f"batches compared: {batches}")


if __name__ == "__main__":
    main()
