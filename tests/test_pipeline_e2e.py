"""prepare -> train -> calibrate -> eval on a tiny target, end to end, through the real CLIs."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dspark.train import calibrate, evaluate, prepare
from dspark.train.trainer import train
from tests.conftest import tiny_hf_model, write_tiny_tokenizer


def test_tiny_pipeline(tmp_path):
    torch.manual_seed(0)
    model_dir = tmp_path / "target"
    hf = tiny_hf_model("llama", num_hidden_layers=4)
    hf.save_pretrained(model_dir)
    write_tiny_tokenizer(model_dir, hf.config.vocab_size)

    data = tmp_path / "data"
    prepare.main(["--model", str(model_dir), "--out", str(data), "--num-prompts", "6", "--max-new-tokens", "12",
                  "--batch", "3", "--shard-size", "3", "--num-ctx-layers", "2"])
    meta = json.loads((data / "meta.json").read_text())
    assert meta["num_sequences"] == 6 and meta["ctx_layers"] == [1, 2]
    shard = load_file(str(data / meta["shards"][0]))
    n = int(shard["offsets"][-1])
    assert shard["features"].shape == (n, 2 * 64) and shard["final_hidden"].shape == (n, 64)
    assert 0 < int(shard["loss_mask"].sum()) < n  # responses supervised, prompts not

    # resuming prepare skips what is done
    prepare.main(["--model", str(model_dir), "--out", str(data), "--num-prompts", "6", "--max-new-tokens", "12",
                  "--batch", "3", "--shard-size", "3", "--num-ctx-layers", "2"])
    assert json.loads((data / "meta.json").read_text())["num_sequences"] == 6

    out = tmp_path / "run"
    cfg = {"target": str(model_dir),
           "drafter": {"kind": "dspark", "num_layers": 1, "gamma": 3, "markov_rank": 8, "version": "tiny"},
           "train": {"steps": 6, "batch_sequences": 2, "max_block_tokens": 64, "save_every": 3, "warmup_steps": 2}}
    train(cfg, data, out, show_progress=False)
    drafter_dir = out / "drafter"
    assert (drafter_dir / "config.json").exists()

    calibrate.main(["--model", str(model_dir), "--drafter", str(drafter_dir), "--prompts", "4", "--max-tokens", "8"])
    cal = json.loads((drafter_dir / "calibration.json").read_text())
    assert len(cal["temperatures"]) == 3 and all(t > 0 for t in cal["temperatures"])

    eval_dir = tmp_path / "eval"
    evaluate.main(["--model", str(model_dir), "--drafters", str(drafter_dir), "--out", str(eval_dir),
                   "--datasets", "gsm8k", "mbpp", "--prompts-per-dataset", "2", "--max-tokens", "8"])
    results = json.loads((eval_dir / "results.json").read_text())
    for temperature in ("0.0", "1.0"):
        parts = [results[f"dspark|{temperature}|{d}"] for d in ("gsm8k", "mbpp")]
        whole = results[f"dspark|{temperature}|all"]
        # Every block is verified whole (gamma 3, up to the room left): the counts must add up.
        assert all(p["drafts"] > 0 for p in parts)
        assert whole["drafts"] == sum(p["drafts"] for p in parts)
        assert whole["accepted"] == sum(p["accepted"] for p in parts)
        for entry in parts + [whole]:
            assert entry["tau"] == pytest.approx(1 + entry["accepted"] / entry["drafts"])
        # One (confidence, outcome) sample per verified block at position 1.
        assert whole["confidence"]["raw"]["count"][0] == whole["drafts"]
    assert (eval_dir / "per_position_acceptance.png").exists() and (eval_dir / "reliability.png").exists()
