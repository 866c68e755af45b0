"""The regeneration job: token-id records, multi-turn continuation, resume without duplicates."""
from __future__ import annotations

import torch

from dspark.train import regenerate
from dspark.train.corpus.build import read_jsonl, write_jsonl_gz
from tests.conftest import tiny_hf_model, write_tiny_tokenizer


def test_follow_up_ids_continue_the_chat_template(smollm2):
    tok = smollm2.tokenizer
    first, answer, second = "Name a colour.", "Blue.", "And another one?"
    eos = tok.eos_token
    answer_ids = tok.encode(answer) + [tok.tok.token_to_id(eos)]
    ids = tok.encode_chat([{"role": "user", "content": first}]) + answer_ids + \
        regenerate.follow_up_ids(tok, second, eos)
    expected = tok.apply_chat_template([{"role": "user", "content": first}, {"role": "assistant", "content": answer},
                                        {"role": "user", "content": second}])
    assert tok.decode(ids, skip_special_tokens=False) == expected
    # An answer cut by length gets the end-of-turn token from the glue instead.
    cut = tok.encode_chat([{"role": "user", "content": first}]) + tok.encode(answer) + \
        regenerate.follow_up_ids(tok, second, None)
    assert tok.decode(cut, skip_special_tokens=False) == expected


def test_sampling_settings_are_a_function_of_the_id_with_a_greedy_share():
    settings = [regenerate.sampling_for(f"p{i:06d}", i, 0, 0.2, 512) for i in range(2000)]
    assert settings == [regenerate.sampling_for(f"p{i:06d}", i, 0, 0.2, 512) for i in range(2000)]
    greedy = sum(s["temperature"] == 0 for s in settings) / len(settings)
    assert 0.17 < greedy < 0.23
    sampled = next(s for s in settings if s["temperature"] > 0)
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"]) == (0.7, 0.8, 20)


def test_job_writes_token_records_and_resumes_without_redoing(tmp_path):
    torch.manual_seed(0)
    model_dir = tmp_path / "target"
    hf = tiny_hf_model("llama")
    hf.save_pretrained(model_dir)
    write_tiny_tokenizer(model_dir, hf.config.vocab_size)
    prompts = [dict(id=f"p{i:06d}", source="templates", category="chat", turns=[f"w{10 + i} w{20 + i}"])
               for i in range(5)]
    prompts.append(dict(id="p000005", source="templates", category="multi-turn", turns=["w30 w31", "w40"]))
    path = tmp_path / "prompts.jsonl.gz"
    write_jsonl_gz(path, prompts)
    out = tmp_path / "regen"
    args = ["--model", str(model_dir), "--prompts", str(path), "--out", str(out), "--batch", "2",
            "--max-new-tokens", "6", "--shard-size", "2", "--precision", "fp32", "--max-len", "128"]

    regenerate.main(args + ["--limit", "3"])
    first = sorted(out.glob("shard_*.jsonl.gz"))
    assert sorted(r["id"] for s in first for r in read_jsonl(s)) == ["p000000", "p000001", "p000002"]
    before = {s.name: s.read_bytes() for s in first}

    regenerate.main(args)  # the whole file: only the three missing records are decoded
    shards = sorted(out.glob("shard_*.jsonl.gz"))
    assert all(s.read_bytes() == before[s.name] for s in first)  # append-only
    records = [r for s in shards for r in read_jsonl(s)]
    assert sorted(r["id"] for r in records) == [p["id"] for p in prompts]
    for r in records:
        assert set(r["sampling"]) == {"temperature", "top_p", "top_k", "seed", "max_tokens"}
        for turn in r["turns"]:
            assert turn["prompt_ids"] and 1 <= len(turn["response_ids"]) <= 6
            assert turn["finish"] in ("stop", "length", "loop")
    multi = next(r for r in records if r["id"] == "p000005")
    assert len(multi["turns"]) == 2


def test_committed_snapshot_matches_the_corpus_and_its_settings(smollm2):
    """Every committed record answers a corpus prompt: same id, its first turn's ids, its sampling."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    shards = sorted((repo / "datasets" / "train" / "regen").glob("shard_*.jsonl.gz"))
    assert shards
    prompts = read_jsonl(repo / "datasets" / "train" / "prompts.jsonl.gz")
    index = {p["id"]: (i, p) for i, p in enumerate(prompts)}
    records = [r for s in shards for r in read_jsonl(s)]
    assert len({r["id"] for r in records}) == len(records)
    eos = set(smollm2.model.config.eos_token_ids)
    for r in records[:200]:
        i, prompt = index[r["id"]]
        first_turn = [{"role": "user", "content": prompt["turns"][0]}]
        assert r["turns"][0]["prompt_ids"] == smollm2.tokenizer.encode_chat(first_turn)
        assert r["sampling"] == regenerate.sampling_for(r["id"], i, 0, 0.2, 512)
        for t in r["turns"]:
            assert (t["response_ids"][-1] in eos) == (t["finish"] == "stop")
            assert not eos & set(t["response_ids"][:-1])
