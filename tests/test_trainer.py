import json

import pytest
import torch
from safetensors.torch import load_file

from dspark.drafters.checkpoint import load_drafter
from dspark.train.anchors import candidate_anchors, sample_anchors, slot_validity, ttt_validity
from dspark.train.config import TrainConfig, load_train_config
from dspark.train.dataset import CachedDataset, OnlineDataset, build_tiny_dataset
from dspark.train.trainer import TargetLSE, choose_draft_vocab, lr_factor, train

CTX_LAYERS = [1, 2]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def data_dir(target, tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny_dataset(target, tmp_path_factory.mktemp("data"), CTX_LAYERS, num_sequences=6,
                              prompt_len=5, response_len=20, temperature=0.5)


def config(kind, steps, **train):
    t = {"steps": steps, "lr": 3e-3, "warmup_steps": 2, "batch_sequences": 2, "max_block_tokens": 96,
         "save_every": 1000}
    t.update(train)
    return {"drafter": {"kind": kind, "num_layers": 1, "gamma": 4, "markov_rank": 16, "draft_vocab_size": 48},
            "train": t}


# ---- anchors ----
def test_slot_validity_stops_at_the_first_unsupervised_slot():
    loss_mask = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    valid = slot_validity(torch.tensor([1, 2, 4, 5, 6]), loss_mask, gamma=3)
    assert valid.tolist() == [
        [True, True, False],  # 2, 3 response; 4 is prompt -> slot 3 and later invalid
        [True, False, False],  # 3 ok, 4 prompt
        [True, True, True],  # 5, 6, 7
        [True, True, False],  # 6, 7, then past the end of the sequence
        [True, False, False],  # 7, then past the end
    ]


def test_candidate_and_sampled_anchors_have_a_supervised_first_slot():
    loss_mask = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    assert candidate_anchors(loss_mask).tolist() == [1, 2, 4, 5, 6]
    gen = torch.Generator().manual_seed(0)
    picked = sample_anchors(loss_mask, 3, gen)
    assert picked.numel() == 3 and len(set(picked.tolist())) == 3
    assert set(picked.tolist()) <= {1, 2, 4, 5, 6}
    assert sample_anchors(loss_mask, 100, gen).tolist() == [1, 2, 4, 5, 6]


def test_ttt_validity():
    loss_mask = torch.tensor([0, 0, 1, 1, 1], dtype=torch.bool)
    valid = ttt_validity(loss_mask, num_steps=2)  # rows p = 0..3 predict tokens p+2
    assert valid.tolist() == [[True, True, True, False], [False, True, True, False]]


def test_lr_schedule_warms_up_then_decays():
    t = TrainConfig(warmup_steps=4, steps=20, min_lr_ratio=0.1)
    factors = [lr_factor(s, t) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
    assert factors[-1] >= 0.1 and lr_factor(100, t) == pytest.approx(0.1)


def test_draft_vocab_keeps_the_most_frequent_tokens():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    assert choose_draft_vocab(counts, 3).tolist() == [2, 3, 5]


# ---- data ----
def test_cached_dataset_matches_online_features(target, data_dir):
    cached = CachedDataset(data_dir)
    meta = json.loads((data_dir / "meta.json").read_text())
    assert meta["ctx_layers"] == CTX_LAYERS and meta["num_sequences"] == 6 == len(cached)
    online = OnlineDataset(target, [(cached[i].tokens, cached[i].loss_mask) for i in range(len(cached))], CTX_LAYERS)
    for i in (0, 5):
        a, b = cached[i], online[i]
        assert a.tokens.shape == (25,) and a.loss_mask.sum() == 20
        assert a.features.shape == (25, 2 * 32) and a.final_hidden.shape == (25, 32)
        torch.testing.assert_close(a.features, b.features, atol=0.05, rtol=0.01)  # bf16 on disk
        torch.testing.assert_close(a.final_hidden, b.final_hidden, atol=0.05, rtol=0.01)
    assert cached.token_counts(64).sum() == 6 * 25


def test_target_lse_on_demand_matches_full_logsumexp(target, data_dir):
    seq = CachedDataset(data_dir)[0]
    lm_head = target.lm_head.weight.detach()
    full = torch.logsumexp(seq.final_hidden @ lm_head.T, -1)
    lse = TargetLSE(lm_head, chunk=4)
    positions = torch.tensor([7, 3, 12])
    torch.testing.assert_close(lse(0, seq, positions), full[positions])
    torch.testing.assert_close(lse(0, seq, torch.arange(25)), full)


# ---- trainer ----
@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_resume_equals_uninterrupted_run(target, data_dir, tmp_path, kind):
    cfg = config(kind, steps=6)
    train(cfg, data_dir, tmp_path / "straight", target=target, show_progress=False)
    train(cfg, data_dir, tmp_path / "resumed", target=target, show_progress=False, stop_after=3)
    assert (tmp_path / "resumed" / "checkpoints" / "step_0000003").is_dir()
    train(cfg, data_dir, tmp_path / "resumed", target=target, show_progress=False)
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "step_0000006" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "checkpoints" / "step_0000006" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)
    log_a = [json.loads(line) for line in (tmp_path / "straight" / "log.jsonl").read_text().splitlines()]
    log_b = [json.loads(line) for line in (tmp_path / "resumed" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log_b] == list(range(1, 7))
    assert [r["loss"] for r in log_a] == pytest.approx([r["loss"] for r in log_b], abs=1e-6)


def test_init_starts_from_a_saved_drafter_and_refuses_other_shapes(target, data_dir, tmp_path):
    """--init: step 1 of the new run starts from the saved weights (its loss is the old run's level,
    not a fresh drafter's), and a drafter of another shape is refused before any step runs."""
    first = train(config("dspark", steps=30, lr=1e-2), data_dir, tmp_path / "first", target=target,
                  show_progress=False)
    fresh = train(config("dspark", steps=1), data_dir, tmp_path / "fresh", target=target, show_progress=False)
    warm = train(config("dspark", steps=1), data_dir, tmp_path / "warm", target=target, show_progress=False,
                 init=first["drafter_dir"])
    assert warm["final"]["loss"] < 0.97 * fresh["final"]["loss"]
    # Grown data ranks other tokens into the draft vocabulary: a warm start keeps the one its rows were trained on.
    grown = build_tiny_dataset(target, tmp_path / "grown", CTX_LAYERS, num_sequences=6, prompt_len=5,
                               response_len=20, temperature=1.5, seed=7)
    assert not torch.equal(choose_draft_vocab(CachedDataset(grown).token_counts(target.config.vocab_size), 48),
                           load_file(f"{first['drafter_dir']}/model.safetensors")["draft_vocab"])
    regrown = train(config("dspark", steps=1), grown, tmp_path / "regrown", target=target, show_progress=False,
                    init=first["drafter_dir"])
    assert torch.equal(load_file(f"{regrown['drafter_dir']}/model.safetensors")["draft_vocab"],
                       load_file(f"{first['drafter_dir']}/model.safetensors")["draft_vocab"])
    other = config("dspark", steps=1)
    other["drafter"]["markov_rank"] = 8
    with pytest.raises(ValueError, match="do not match"):
        train(other, data_dir, tmp_path / "other", target=target, show_progress=False, init=first["drafter_dir"])


@pytest.mark.parametrize("kind,bf16", [("dspark", False), ("dflash", False), ("dspark", True)])
def test_training_reduces_the_loss(target, data_dir, tmp_path, kind, bf16):
    """bf16: the drafter's matmuls under bf16 autocast (train.bf16, AMX) learn as well."""
    summary = train(config(kind, steps=40, lr=1e-2, bf16=bf16), data_dir, tmp_path, target=target,
                    show_progress=False)
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]

    def mean(key, part):
        return sum(r[key] for r in part) / len(part)

    if kind == "dflash":  # cross-entropy only
        assert mean("loss", records[-5:]) < 0.8 * mean("loss", records[:5])
    else:  # the confidence BCE has an entropy floor: check the distance and the acceptance proxy too
        assert mean("loss", records[-5:]) < 0.95 * mean("loss", records[:5])
        assert mean("tv", records[-5:]) < 0.92 * mean("tv", records[:5])
        assert mean("accept_len", records[-5:]) > mean("accept_len", records[:5]) + 0.1
    assert (tmp_path / "loss.png").stat().st_size > 1000
    drafter = load_drafter(summary["drafter_dir"], target.model.embed_tokens.weight, target.lm_head.weight)
    assert drafter.kind == kind and drafter.cfg.draft_vocab == 48 and drafter.ctx_layers == CTX_LAYERS


def test_train_config_is_typed_and_refuses_what_it_does_not_know():
    cfg = load_train_config({"drafter": {"kind": "dspark"}, "train": {"steps": 30, "lr": 1, "betas": [0.8, 0.9]}})
    t = cfg["train"]
    assert (t.steps, t.lr, t.betas, t.seed) == (30, 1, (0.8, 0.9), 0)  # an int where a float goes is fine
    assert TrainConfig.from_dict(t.to_dict()) == t
    for bad, word in (({"stepz": 3}, "stepz"), ({"steps": "30"}, "steps"), ({"lr": "fast"}, "lr"),
                      ({"mix": {"kl": 1.0}}, "kl")):
        with pytest.raises(ValueError, match=word):
            load_train_config({"drafter": {"kind": "dspark"}, "train": bad})
    with pytest.raises(ValueError, match="drafter.kind"):
        load_train_config({"drafter": {}})
    with pytest.raises(ValueError, match="sections"):
        load_train_config({"drafter": {"kind": "dflash"}, "trian": {}})
