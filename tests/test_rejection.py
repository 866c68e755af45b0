import pytest
import torch
import torch.nn.functional as F
from scipy.stats import chisquare

from dspark.sampling import logits_to_probs, truncated_draft_distribution
from dspark.speculative.rejection import draw_uniforms, greedy_verify, rejection_sample, rejection_sample_auto

V = 5


def _greedy_batch(requests):
    """requests: list of (draft tokens, target argmax per row); returns rejection_sample inputs."""
    drafts = [t for draft, _ in requests for t in draft]
    argmaxes = [a for _, target in requests for a in target]
    support_ids = torch.zeros(len(drafts), 3, dtype=torch.int64)
    support_ids[:, 0] = torch.tensor(drafts, dtype=torch.int64)
    support_probs = torch.zeros(len(drafts), 3)
    support_probs[:, 0] = 1.0
    return (
        F.one_hot(torch.tensor(argmaxes, dtype=torch.int64), V).float(),
        torch.tensor(drafts, dtype=torch.int64),
        support_ids,
        support_probs,
        torch.tensor([len(draft) for draft, _ in requests], dtype=torch.int64),
    )


def test_greedy_is_exact_argmax_matching():
    requests = [
        ([1, 2, 3], [1, 2, 3, 4]),  # all accepted + bonus
        ([2, 2], [0, 2, 1]),  # rejected at position 0
        ([], [3]),  # nothing to verify: bonus only
        ([4, 0, 1, 1], [4, 0, 2, 3, 3]),  # rejected at position 2
    ]
    inputs = _greedy_batch(requests)
    expected_tokens = torch.tensor([[1, 2, 3, 4, -1], [0, -1, -1, -1, -1], [3, -1, -1, -1, -1], [4, 0, 2, -1, -1]])
    gen = torch.Generator().manual_seed(0)
    for uniforms in (torch.rand(9, generator=gen), torch.zeros(9), torch.full((9,), 1 - 2**-24)):
        num_accepted, tokens = rejection_sample(*inputs, uniforms[:9], uniforms[:4])
        assert torch.equal(num_accepted, torch.tensor([3, 0, 0, 2]))
        assert torch.equal(tokens, expected_tokens)


def test_greedy_matches_argmax_loop_on_random_logits():
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(0, 5, (12,), generator=gen)
    num_drafts, num_requests, vocab = int(lens.sum()), 12, 30
    target_logits = torch.randn(num_drafts + num_requests, vocab, generator=gen)
    zeros = torch.zeros(num_drafts + num_requests)
    target = logits_to_probs(target_logits, zeros, zeros.long(), torch.ones_like(zeros))
    # Draft logits = the target's at the draft rows plus noise, so acceptance runs vary.
    starts = (lens.cumsum(0) - lens).tolist()
    draft_rows = torch.cat([torch.arange(n) + start + r for r, (start, n) in enumerate(zip(starts, lens.tolist()))])
    draft_logits = target_logits[draft_rows] + 0.8 * torch.randn(num_drafts, vocab, generator=gen)
    drafts, ids, probs = truncated_draft_distribution(draft_logits, torch.zeros(num_drafts), 4, [None] * num_drafts)
    num_accepted, tokens = rejection_sample(target, drafts, ids, probs, lens, *draw_uniforms(lens, [gen] * 12))

    start = 0
    for r, n in enumerate(lens.tolist()):
        want = target_logits[start + r : start + r + n + 1].argmax(dim=-1)
        matched = 0
        while matched < n and drafts[start + matched] == want[matched]:
            matched += 1
        assert num_accepted[r] == matched
        assert torch.equal(tokens[r, : matched + 1], want[: matched + 1])
        assert (tokens[r, matched + 1 :] == -1).all()
        start += n
    assert 0 < num_accepted.sum() < lens.sum()  # the case mixes accepts and rejects


def test_greedy_verify_is_rejection_sample_on_one_hot_rows():
    """The engine's all-greedy path gives rejection_sample's tokens for any drafts, any draft q."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        lens = torch.randint(0, 6, (8,), generator=gen)
        num_drafts, vocab = int(lens.sum()), 7  # a small vocabulary: many drafts match
        target_logits = torch.randn(num_drafts + 8, vocab, generator=gen)
        zeros = torch.zeros(num_drafts + 8)
        target = logits_to_probs(target_logits, zeros, zeros.long(), torch.ones_like(zeros))
        # Sampled drafts at T 1: q is not one-hot, and its support may miss the target's argmax.
        drafts, ids, probs = truncated_draft_distribution(torch.randn(num_drafts, vocab, generator=gen),
                                                          torch.ones(num_drafts), 3, [gen] * num_drafts)
        want_accepted, want_tokens = rejection_sample(target, drafts, ids, probs, lens, *draw_uniforms(lens, [gen] * 8))
        per_request = torch.split(drafts, lens.tolist())
        got_accepted, got_tokens = greedy_verify(target_logits.argmax(-1).tolist(), [d.tolist() for d in per_request])
        assert got_accepted == want_accepted.tolist()
        for r, tokens in enumerate(got_tokens):
            assert tokens == want_tokens[r, : want_accepted[r] + 1].tolist()
    with pytest.raises(ValueError):  # a row count that does not match the drafts
        greedy_verify([1, 2], [[1, 2]])


def test_rejection_samples_the_residual():
    # p = (0.5, 0.5, 0, 0, 0), q = one-hot on 0: x = 0 is rejected when u >= 0.5, then the
    # residual max(0, p - q) only has mass on token 1.
    target = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    args = (target, torch.tensor([0]), torch.tensor([[0, 4]]), torch.tensor([[1.0, 0.0]]), torch.tensor([1]))
    num_accepted, tokens = rejection_sample(*args, torch.tensor([0.7]), torch.tensor([0.0]))
    assert num_accepted.tolist() == [0] and tokens.tolist() == [[1, -1]]
    num_accepted, tokens = rejection_sample(*args, torch.tensor([0.3]), torch.tensor([0.0]))
    assert num_accepted.tolist() == [1] and tokens.tolist() == [[0, 2]]


def test_empty_residual_falls_back_to_target():
    # q is (deliberately) not normalised and dominates p everywhere, so after the rejection
    # max(0, p - q) is zero and the token must come from p = (0.25, 0.5, 0.25, 0, 0).
    target = torch.tensor([[0.25, 0.5, 0.25, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    args = (target, torch.tensor([0]), torch.tensor([[0, 1, 2]]), torch.tensor([[0.5, 0.5, 0.25]]), torch.tensor([1]))
    for u_residual, want in ((0.1, 0), (0.5, 1), (0.9, 2)):
        num_accepted, tokens = rejection_sample(*args, torch.tensor([0.9]), torch.tensor([u_residual]))
        assert num_accepted.tolist() == [0]
        assert tokens.tolist() == [[want, -1]]


def test_emitted_tokens_follow_the_target_distribution():
    num_requests, vocab = 20_000, 6
    gen = torch.Generator().manual_seed(1234)
    p = torch.rand(2, vocab, generator=gen)
    p[0, 3] = 0.0  # a token the draft proposes but the target never emits
    p = p / p.sum(dim=-1, keepdim=True)
    support_ids = torch.tensor([[1, 3, 4], [0, 2, 5]])
    support_probs = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.2, 0.2]])

    # Every request verifies 2 drafts, each sampled from its sparse q.
    picks = torch.stack(
        [torch.multinomial(support_probs[k], num_requests, replacement=True, generator=gen) for k in range(2)], dim=1
    )
    draft_tokens = support_ids[torch.arange(2), picks].reshape(-1)
    target = torch.cat([p, torch.full((1, vocab), 1 / vocab)]).repeat(num_requests, 1)
    lens = torch.full((num_requests,), 2)
    num_accepted, tokens = rejection_sample(
        target,
        draft_tokens,
        support_ids.repeat(num_requests, 1),
        support_probs.repeat(num_requests, 1),
        lens,
        torch.rand(2 * num_requests, generator=gen),
        torch.rand(num_requests, generator=gen),
    )

    # The first emitted token follows p_0; given x_1 was accepted, the second follows p_1.
    for position, emitted in ((0, tokens[:, 0]), (1, tokens[num_accepted >= 1, 1])):
        counts = torch.bincount(emitted, minlength=vocab).double()
        expected = p[position].double() * counts.sum()
        assert (counts[expected == 0] == 0).all()
        keep = expected > 0
        assert chisquare(counts[keep], expected[keep] * counts[keep].sum() / expected[keep].sum()).pvalue > 0.001
    assert 0 < (num_accepted == 0).sum() < num_requests  # both outcomes occur


def test_draw_uniforms_per_request_generator():
    lens = torch.tensor([2, 0, 3])
    accept, residual = draw_uniforms(lens, [torch.Generator().manual_seed(s) for s in (5, 6, 7)])
    assert accept.shape == (5,) and residual.shape == (3,)
    third = torch.rand(4, generator=torch.Generator().manual_seed(7))
    assert torch.equal(accept[2:], third[:3]) and residual[2] == third[3]
    again = draw_uniforms(lens, [torch.Generator().manual_seed(s) for s in (5, 6, 7)])
    assert torch.equal(accept, again[0]) and torch.equal(residual, again[1])


def test_auto_on_cpu_is_the_reference():
    inputs = _greedy_batch([([1, 2], [1, 3, 0]), ([], [4])])
    uniforms = (torch.rand(2), torch.rand(2))
    for got, want in zip(rejection_sample_auto(*inputs, *uniforms), rejection_sample(*inputs, *uniforms)):
        assert torch.equal(got, want)
    num_accepted, tokens = rejection_sample_auto(*_greedy_batch([]), torch.empty(0), torch.empty(0))
    assert num_accepted.shape == (0,) and tokens.shape == (0, 1)
