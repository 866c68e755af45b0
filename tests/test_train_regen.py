"""Training from regenerated shards: sequences and loss masks, the held-out split, the feature
cache, the held-out loss, and the command line on the real target."""
import gzip
import json

import pytest
import torch

from dspark.models.precision import has_bf16_matmul
from dspark.train import dataset as dataset_module
from dspark.train.dataset import OnlineDataset
from dspark.train.regen_data import LOOP_UNSUPERVISED, is_held_out, load_split, read_records, to_sequence
from dspark.train.trainer import main, train

CTX_LAYERS = [1, 2]
# --feature-precision bf16 is refused on such CPUs (set_precision raises), so there is nothing to test
needs_bf16 = pytest.mark.skipif(not has_bf16_matmul(), reason="bf16 precision is refused on this CPU: it has "
                                "neither AVX-512 (BW/VL/DQ) nor AVX-NE-CONVERT for oneDNN's bf16 kernels")
pytestmark = pytest.mark.usefixtures("one_thread")


def record(rid, turns):
    return {"id": rid, "source": "templates", "category": "chat", "precision": "fp32",
            "sampling": {"temperature": 0.7}, "turns": turns}


def write_shards(directory, records, per_shard=3):
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(0, len(records), per_shard):
        with gzip.open(directory / f"shard_{i // per_shard:05d}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in records[i:i + per_shard])


def random_records(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(0, vocab, (6,), generator=g).tolist()
        answer = torch.randint(0, vocab, (18,), generator=g).tolist()
        out.append(record(f"r{i:03d}", [{"prompt_ids": prompt, "response_ids": answer, "finish": "stop"}]))
    return out


def test_a_record_is_its_turns_back_to_back_with_the_loss_on_the_answers():
    rec = record("a", [{"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "finish": "stop"},
                       {"prompt_ids": [6, 7], "response_ids": [8, 9, 10], "finish": "length"}])
    seq = to_sequence(rec)
    assert seq.tokens.tolist() == list(range(1, 11))
    assert seq.loss_mask.tolist() == [False] * 3 + [True] * 2 + [False] * 2 + [True] * 3
    assert to_sequence(rec, max_len=4).tokens.tolist() == [1, 2, 3, 4]


def test_a_loop_keeps_its_first_repeats_under_the_loss_but_not_the_window_that_proved_it():
    answer = list(range(100, 100 + LOOP_UNSUPERVISED + 40))
    seq = to_sequence(record("l", [{"prompt_ids": [1, 2], "response_ids": answer, "finish": "loop"}]))
    assert seq.loss_mask.sum() == 40 and seq.loss_mask[2:42].all() and not seq.loss_mask[42:].any()


def test_the_held_out_split_is_fixed_by_the_id(tmp_path):
    records = random_records(60, 64)
    write_shards(tmp_path / "a", records[:30])
    train_a, held_a = load_split(tmp_path / "a", held_out_share=0.2)
    write_shards(tmp_path / "b", records)  # the data grows: nobody changes sides
    train_b, held_b = load_split(tmp_path / "b", held_out_share=0.2)
    assert {s.id for s in held_a} <= {s.id for s in held_b} and {s.id for s in train_a} <= {s.id for s in train_b}
    assert 3 <= len(held_b) <= 25 and len(train_b) + len(held_b) == 60
    assert all(is_held_out(s.id, 0.2) for s in held_b) and len(read_records(tmp_path / "b")) == 60


def test_the_feature_cache_stores_what_the_target_computes_once(tiny_llama, tmp_path, monkeypatch):
    seqs = [(s.tokens, s.loss_mask) for s in map(to_sequence, random_records(3, 64))]
    cached = OnlineDataset(tiny_llama, seqs, CTX_LAYERS, "tiny", cache_dir=tmp_path)
    plain = OnlineDataset(tiny_llama, seqs, CTX_LAYERS, "tiny")
    first = cached[1]
    assert len(list(tmp_path.rglob("*.safetensors"))) == 1
    torch.testing.assert_close(first.features, plain[1].features, atol=0.05, rtol=0.01)  # bf16 on disk
    logits = first.final_hidden @ tiny_llama.lm_head.weight.detach().T
    torch.testing.assert_close(first.target_lse, torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-5)

    def no_target(*args, **kwargs):
        raise AssertionError("the target ran for a cached sequence")

    monkeypatch.setattr(dataset_module, "target_features", no_target)
    again = OnlineDataset(tiny_llama, seqs, CTX_LAYERS, "tiny", cache_dir=tmp_path)[1]
    assert torch.equal(again.features, first.features) and torch.equal(again.target_lse, first.target_lse)
    with pytest.raises(AssertionError, match="the target ran"):  # another layer set is another cache entry
        OnlineDataset(tiny_llama, seqs, [0, 1], "tiny", cache_dir=tmp_path)[1]


def test_the_held_out_loss_is_logged_and_plotted(tiny_llama, tmp_path):
    seqs = [(s.tokens, s.loss_mask) for s in map(to_sequence, random_records(8, 64))]
    data = OnlineDataset(tiny_llama, seqs[:6], CTX_LAYERS, "tiny")
    heldout = OnlineDataset(tiny_llama, seqs[6:], CTX_LAYERS, "tiny")
    cfg = {"drafter": {"kind": "dspark", "num_layers": 1, "gamma": 4, "markov_rank": 16, "draft_vocab_size": 48,
                       "markov_table": "compact"},
           "train": {"steps": 6, "lr": 3e-3, "warmup_steps": 2, "batch_sequences": 2, "max_block_tokens": 96,
                     "save_every": 1000, "eval_every": 3, "eval_sequences": 2}}
    train(cfg, None, tmp_path, target=tiny_llama, dataset=data, heldout=heldout, show_progress=False)
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    held = [r for r in records if "heldout_loss" in r]
    assert [r["step"] for r in held] == [3, 6]
    assert all(r["heldout_loss"] > 0 and 0 <= r["heldout_accept_len"] <= 4 for r in held)
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_the_command_line_trains_on_regenerated_shards_with_the_real_target(tmp_path, capsys):
    write_shards(tmp_path / "regen", random_records(10, 2000, seed=3))
    cfg = {"drafter": {"kind": "dspark", "num_layers": 1, "gamma": 3, "markov_rank": 8, "draft_vocab_size": 64,
                       "markov_table": "compact", "version": "cli-test"},
           "train": {"steps": 2, "warmup_steps": 1, "batch_sequences": 2, "max_block_tokens": 24,
                     "eval_every": 2, "eval_sequences": 1}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    main(["--config", str(tmp_path / "cfg.json"), "--regen", str(tmp_path / "regen"), "--held-out-share", "0.3",
          "--feature-cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out")])
    said = capsys.readouterr().out
    assert "training and" in said and '"steps_done": 2' in said
    assert any((tmp_path / "cache").rglob("*.safetensors"))
    assert (tmp_path / "out" / "drafter" / "config.json").exists()


@needs_bf16
def test_a_bf16_target_has_its_own_feature_cache_entries_close_to_fp32(tmp_path):
    from dspark.models.loader import load_model
    seqs = [(s.tokens, s.loss_mask) for s in map(to_sequence, random_records(1, 49152, seed=5))]
    fp32, bf16 = load_model("smollm2-135m").model, load_model("smollm2-135m").model
    bf16.set_precision("bf16")
    exact = OnlineDataset(fp32, seqs, CTX_LAYERS, "smollm2-135m", cache_dir=tmp_path)[0]
    fast = OnlineDataset(bf16, seqs, CTX_LAYERS, "smollm2-135m", cache_dir=tmp_path)[0]
    assert len(list(tmp_path.rglob("*.safetensors"))) == 2  # not read from the fp32 entry
    # the bf16 target's logsumexp normalises its own hidden states (bf16 LM-head matmul, fp32 sum)
    lse = torch.logsumexp(fast.final_hidden @ bf16.output_weight.detach().T, -1)
    assert (fast.target_lse - lse).abs().max() < 0.1
    # and its features are near the fp32 target's (precision_quality.py measures the agreement)
    cos = torch.nn.functional.cosine_similarity(fast.final_hidden, exact.final_hidden, dim=-1)
    assert cos.min() > 0.95 and not torch.equal(fast.features, exact.features)


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=needs_bf16)])
def test_teacher_forced_features_match_a_plain_pass_of_the_real_target(precision):
    from dspark.models.batch import VarlenBatch
    from dspark.models.loader import load_model
    model = load_model("smollm2-135m").model
    model.set_precision(precision)
    tokens = torch.randint(0, 49152, (300,), generator=torch.Generator().manual_seed(1))
    features, hidden = dataset_module.target_features(model, tokens, [4, 20])  # one-slot cache, whole calls
    plain = model(VarlenBatch.build([tokens.tolist()], [0]), capture_layers=[4, 20], logits_rows=None)
    tol = 1e-3 if precision == "fp32" else 0.1
    assert (hidden - plain.hidden.float()).abs().max() < tol * hidden.abs().max()
    assert (features - plain.features.float()).abs().max() < tol * features.abs().max()


def test_calibration_prompts_are_corpus_records_the_trainer_never_reads():
    from dspark.train.calibrate import CORPUS, held_out_prompts
    prompts = held_out_prompts(CORPUS, 64)
    assert len(prompts) == 64 and len(set(prompts)) == 64
    with gzip.open(CORPUS, "rt") as f:
        by_text = {}
        for line in f:
            record = json.loads(line)
            by_text.setdefault(record["turns"][0], []).append(record["id"])
    regen = "datasets/train/regen"
    trained = {s.id for s in load_split(regen)[0]}
    for text in prompts:
        assert all(is_held_out(i, 0.02) and i not in trained for i in by_text[text])
    assert held_out_prompts(CORPUS, 64) == prompts  # the same every time
