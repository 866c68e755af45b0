import math

import pytest
import torch

from dspark.train import losses


def test_slot_weights_decay_exponentially():
    w = losses.slot_weights(7, 4.0)
    assert w.shape == (7,)
    assert w[0] == 1.0
    torch.testing.assert_close(w, torch.tensor([math.exp(-(k - 1) / 4) for k in range(1, 8)]))


def test_weighted_mean_ignores_invalid_entries():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    valid = torch.tensor([[True, False], [True, True]])
    weights = torch.tensor([1.0, 0.5])
    # (1*1 + 3*1 + 4*0.5) / (1 + 1 + 0.5)
    assert losses.weighted_mean(values, valid, weights).item() == pytest.approx(2.4)
    changed = values.clone()
    changed[0, 1] = 1e6
    assert losses.weighted_mean(changed, valid, weights).item() == pytest.approx(2.4)
    assert losses.weighted_mean(values, torch.zeros_like(valid), weights).item() == 0.0


def test_target_probs_from_draft_vocab_slice():
    full_logits = torch.tensor([[1.0, 2.0, 0.5, 3.0]])
    lse = torch.logsumexp(full_logits, -1)
    p_in, mass_out = losses.target_probs(full_logits[:, :3], lse)
    full = torch.softmax(full_logits, -1)
    torch.testing.assert_close(p_in, full[:, :3])
    torch.testing.assert_close(mass_out, full[:, 3])


def test_l1_distance_counts_target_mass_outside_the_draft_vocab():
    draft = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    p_in = torch.tensor([[0.25, 0.25, 0.2]])
    mass_out = torch.tensor([0.3])
    l1 = losses.l1_distance(draft, p_in, mass_out)
    # full vocab: p^d = (0.5, .25, .25, 0), p^t = (.25, .25, .2, .3)
    assert l1.item() == pytest.approx(0.25 + 0.0 + 0.05 + 0.3)
    assert losses.acceptance(l1).item() == pytest.approx(0.7)  # sum_v min(p^d, p^t) = .25 + .25 + .2
    same = losses.l1_distance(torch.log(torch.tensor([[0.2, 0.3, 0.5]])), torch.tensor([[0.2, 0.3, 0.5]]),
                              torch.tensor([0.0]))
    assert same.item() == pytest.approx(0.0, abs=1e-6)


def test_token_cross_entropy_and_outside_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]))
    ce = losses.token_cross_entropy(logits, torch.tensor([0, -1]))
    assert ce[0].item() == pytest.approx(math.log(2))
    assert ce[1].item() == 0.0


def _block_case():
    torch.manual_seed(0)
    A, g, V = 3, 4, 5
    logits = torch.randn(A, g, V, requires_grad=True)
    conf = torch.randn(A, g, requires_grad=True)
    p_full = torch.softmax(torch.randn(A, g, V + 2), -1)  # 2 tokens outside the draft vocab
    p_in, mass_out = p_full[..., :V], p_full[..., V:].sum(-1)
    tokens = torch.randint(0, V, (A, g))
    tokens[0, 1] = -1  # a regenerated token outside the draft vocab: no CE there
    valid = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    return logits, conf, p_in, mass_out, tokens, valid


def test_dspark_loss_matches_hand_computation():
    logits, conf, p_in, mass_out, tokens, valid = _block_case()
    w = losses.slot_weights(4, 4.0)
    out = losses.dspark_loss(logits, conf, p_in, mass_out, tokens, valid, w)
    pd = torch.softmax(logits, -1)
    l1 = (pd - p_in).abs().sum(-1) + mass_out
    logp = torch.log_softmax(logits, -1)
    ce_num = ce_den = tv_num = den = conf_num = 0.0
    for a in range(3):
        for k in range(4):
            if not valid[a, k]:
                continue
            den += w[k]
            tv_num += w[k] * l1[a, k]
            label = 1 - 0.5 * l1[a, k]
            z = conf[a, k]
            conf_num += w[k] * -(label * torch.log(torch.sigmoid(z)) + (1 - label) * torch.log(1 - torch.sigmoid(z)))
            if tokens[a, k] >= 0:
                ce_num += w[k] * -logp[a, k, tokens[a, k]]
                ce_den += w[k]
    assert out["tv"].item() == pytest.approx((tv_num / den).item(), rel=1e-5)
    assert out["ce"].item() == pytest.approx((ce_num / ce_den).item(), rel=1e-5)
    assert out["conf"].item() == pytest.approx((conf_num / den).item(), rel=1e-5)
    expected = 0.1 * out["ce"] + 0.9 * out["tv"] + 1.0 * out["conf"]
    assert out["loss"].item() == pytest.approx(expected.item(), rel=1e-6)
    # per-slot acceptance proxy: slot 4 has one valid row, (a=2)
    assert out["accept"][3] == pytest.approx((1 - 0.5 * l1[2, 3]).item(), rel=1e-5)


def test_confidence_labels_are_detached():
    logits, conf, p_in, mass_out, tokens, valid = _block_case()
    out = losses.dspark_loss(logits, conf, p_in, mass_out, tokens, valid, losses.slot_weights(4),
                             mix={"ce": 0.0, "tv": 0.0, "conf": 1.0})
    out["loss"].backward()
    assert logits.grad is None or torch.count_nonzero(logits.grad) == 0
    assert torch.count_nonzero(conf.grad) > 0


def test_dflash_loss_is_cross_entropy_only():
    logits, _, p_in, mass_out, tokens, valid = _block_case()
    out = losses.dflash_loss(logits, p_in, mass_out, tokens, valid, losses.slot_weights(4))
    assert set(out) == {"loss", "ce", "accept"}
    ce = losses.weighted_mean(losses.token_cross_entropy(logits, tokens), valid & (tokens >= 0), losses.slot_weights(4))
    assert out["loss"].item() == pytest.approx(ce.item())


def test_eagle3_loss_weights_steps():
    logits = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    p_in = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    out = losses.eagle3_loss(logits, p_in, torch.zeros(2), torch.tensor([0, 1]), num_steps=2, step_decay=0.8)
    expected = (math.log(2) + 0.8 * -math.log(0.1)) / 1.8
    assert out["loss"].item() == pytest.approx(expected, rel=1e-5)
    assert out["accept"] == pytest.approx([0.5, 0.1], rel=1e-5)
