import pytest
import torch

from dspark.sampling import (SamplingParams, logits_to_probs, sample_from_probs, truncated_draft_distribution)


def _params(n, temperature=1.0, top_k=0, top_p=1.0):
    return (
        torch.full((n,), float(temperature)),
        torch.full((n,), int(top_k), dtype=torch.int64),
        torch.full((n,), float(top_p)),
    )


def test_greedy_rows_are_one_hot_on_lowest_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    probs = logits_to_probs(logits, *_params(2, temperature=0.0))
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_temperature_scales_softmax():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    probs = logits_to_probs(logits, *_params(1, temperature=2.0))
    torch.testing.assert_close(probs[0], torch.softmax(logits[0] / 2.0, dim=-1))


def test_top_k_keeps_k_largest_and_renormalises():
    base = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
    probs = logits_to_probs(base.log()[None], *_params(1, top_k=2))
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 0.4, 0.0, 0.3, 0.0]) / 0.7)


def test_top_p_keeps_smallest_set_reaching_mass():
    base = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
    # 0.4 + 0.3 = 0.7 < 0.75, so 0.15 must join; 0.4 + 0.3 + 0.15 = 0.85 >= 0.75 is enough.
    probs = logits_to_probs(base.log()[None], *_params(1, top_p=0.75))
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 0.4, 0.0, 0.3, 0.15]) / 0.85)
    # A tiny top_p still keeps the most likely token.
    probs = logits_to_probs(base.log()[None], *_params(1, top_p=0.01))
    assert torch.equal(probs[0], torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))


def test_top_p_applies_to_top_k_distribution():
    base = torch.tensor([0.5, 0.3, 0.2])
    # After top-2: (0.625, 0.375); top_p 0.6 is reached by the first token alone.
    probs = logits_to_probs(base.log()[None], *_params(1, top_k=2, top_p=0.6))
    assert torch.equal(probs[0], torch.tensor([1.0, 0.0, 0.0]))


def test_mixed_params_per_row():
    base = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15]).log()
    logits = base.repeat(4, 1)
    temperature = torch.tensor([0.0, 1.0, 1.0, 1.0])
    top_k = torch.tensor([0, 0, 2, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.75])
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    expected = torch.stack(
        [
            torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]),
            torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15]),
            torch.tensor([0.0, 0.4, 0.0, 0.3, 0.0]) / 0.7,
            torch.tensor([0.0, 0.4, 0.0, 0.3, 0.15]) / 0.85,
        ]
    )
    torch.testing.assert_close(probs, expected)


def test_sampling_is_reproducible_per_row_seed():
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), dim=-1)

    def draw(seeds):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return torch.stack([sample_from_probs(probs, gens) for _ in range(20)])

    first, again = draw([7, 8, 9]), draw([7, 8, 9])
    assert torch.equal(first, again)
    # Row 0 depends only on its own seed, not on the other rows' generators.
    assert torch.equal(first[:, 0], draw([7, 100, 200])[:, 0])
    assert not torch.equal(first[:, 0], draw([70, 8, 9])[:, 0])


def test_sampling_follows_probs_and_greedy_rows_give_argmax():
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.5]])
    gens = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    tokens = torch.stack([sample_from_probs(probs, gens) for _ in range(400)])
    assert (tokens[:, 0] == 2).all()
    assert set(tokens[:, 1].tolist()) == {0, 3}
    assert 150 < (tokens[:, 1] == 0).sum() < 250


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("temperature", -0.1, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -1, "top_k"),
        ("max_tokens", 0, "max_tokens"),
    ],
)
def test_validation_errors(field, value, message):
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=message):
        params.validate()


def test_valid_params_pass_and_seed_gives_generator():
    params = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=3, stop_token_ids=(2,))
    params.validate()
    first, again = params.make_generator(), params.make_generator()
    assert torch.equal(torch.rand(4, generator=first), torch.rand(4, generator=again))
    assert SamplingParams().make_generator() is None


def test_truncated_distribution_sums_to_one_and_contains_token():
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(0))
    temperature = torch.tensor([1.0, 0.5, 0.0, 2.0]).repeat(16)
    gens = [torch.Generator().manual_seed(i) for i in range(64)]
    tokens, ids, probs = truncated_draft_distribution(logits, temperature, 8, gens)
    assert ids.shape == probs.shape == (64, 8)
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(64))
    token_prob = torch.where(ids == tokens[:, None], probs, 0.0).sum(dim=-1)
    assert (token_prob > 0).all()
    # Sampled rows: the support is the top-8 of softmax(logits / T), renormalised.
    full = torch.softmax(logits[1] / 0.5, dim=-1)
    top = full.topk(8)
    assert set(ids[1].tolist()) == set(top.indices.tolist())
    torch.testing.assert_close(probs[1], full[ids[1]] / top.values.sum())
    # Greedy rows: argmax with probability 1, then zero padding.
    greedy = temperature == 0
    assert torch.equal(tokens[greedy], logits[greedy].argmax(dim=-1))
    assert torch.equal(ids[greedy, 0], tokens[greedy])
    assert (probs[greedy, 0] == 1).all() and (probs[greedy, 1:] == 0).all() and (ids[greedy, 1:] == 0).all()


def test_truncated_distribution_samples_from_its_support():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -9.0]]).repeat(3000, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(3000)]
    tokens, ids, probs = truncated_draft_distribution(logits, torch.ones(3000), 3, gens)
    counts = torch.bincount(tokens, minlength=5).float() / 3000
    expected = torch.zeros(5)
    expected[:3] = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), dim=-1)
    assert (counts - expected).abs().max() < 0.03
    with pytest.raises(ValueError, match="support_size"):
        truncated_draft_distribution(logits[:1], torch.ones(1), 6, gens[:1])
