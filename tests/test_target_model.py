"""The torch target model against transformers, the varlen batch, the KV cache and rollback."""
from __future__ import annotations

import pytest
import torch

from dspark.models.batch import VarlenBatch
from dspark.models.loader import load_model
from tests.conftest import tiny_hf_model, write_tiny_tokenizer

CASES = [
    ("llama", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
               "tie_word_embeddings": True}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
]
TOL = 1e-4


@pytest.fixture(scope="module", params=range(len(CASES)), ids=[f"{a}-{i}" for i, (a, _) in enumerate(CASES)])
def pair(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    torch.manual_seed(request.param)
    hf = tiny_hf_model(arch, **overrides)
    path = tmp_path_factory.mktemp(arch)
    hf.save_pretrained(path, max_shard_size="200KB")  # sharded: exercises the index file
    write_tiny_tokenizer(path, hf.config.vocab_size)
    return hf, load_model(str(path)).model


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_sharded_checkpoint_was_used(pair):
    hf, ours = pair
    assert sum(p.numel() for p in ours.parameters()) > 0
    assert ours.config.num_layers == hf.config.num_hidden_layers


def test_logits_match_without_cache(pair):
    hf, ours = pair
    ids = torch.randint(0, 96, (150,)).tolist()  # longer than the yarn/llama3 original context
    out = ours(VarlenBatch.build([ids], [0]), None, logits_rows="all")
    assert (out.logits - hf_logits(hf, ids)).abs().max() <= TOL


def test_logits_match_with_cache_prefill_then_decode(pair):
    hf, ours = pair
    ids = torch.randint(0, 96, (40,)).tolist()
    ref = hf_logits(hf, ids)
    cache = ours.new_cache(2, 64)
    slot = cache.allocate()
    first = ours(VarlenBatch.build([ids[:25]], [0], [slot]), cache, logits_rows="all").logits
    assert (first - ref[:25]).abs().max() <= TOL
    chunk = ours(VarlenBatch.build([ids[25:32]], [25], [slot]), cache, logits_rows="all").logits  # a draft block
    assert (chunk - ref[25:32]).abs().max() <= TOL
    for i in range(32, 40):  # one token at a time
        step = ours(VarlenBatch.build([[ids[i]]], [i], [slot]), cache).logits
        assert (step[0] - ref[i]).abs().max() <= TOL


def test_varlen_batch_equals_each_alone(pair):
    hf, ours = pair
    lengths, new = [5, 17, 9, 30], [1, 6, 3, 8]
    seqs = [torch.randint(0, 96, (n + k,)).tolist() for n, k in zip(lengths, new)]
    # without cache: whole sequences in one flattened batch
    out = ours(VarlenBatch.build(seqs, [0] * 4), None, logits_rows="all").logits
    row = 0
    for s in seqs:
        assert (out[row:row + len(s)] - hf_logits(hf, s)).abs().max() <= TOL
        row += len(s)
    # with cache: prefill each, then one pass where each sequence brings a different number of tokens
    cache = ours.new_cache(8, 64)
    slots = [cache.allocate() for _ in seqs][::-1]  # non-contiguous order on purpose
    ours(VarlenBatch.build([s[:n] for s, n in zip(seqs, lengths)], [0] * 4, slots), cache)
    out = ours(VarlenBatch.build([s[n:] for s, n in zip(seqs, lengths)], lengths, slots), cache, logits_rows="all").logits
    row = 0
    for s, n, k in zip(seqs, lengths, new):
        assert (out[row:row + k] - hf_logits(hf, s)[n:]).abs().max() <= TOL
        row += k


def test_rollback_then_reforward_equals_never_going_past(pair):
    _, ours = pair
    ids = torch.randint(0, 96, (20,)).tolist()
    rejected = torch.randint(0, 96, (6,)).tolist()
    accepted = torch.randint(0, 96, (4,)).tolist()
    cache = ours.new_cache(2, 64)
    slot = cache.allocate()
    ours(VarlenBatch.build([ids], [0], [slot]), cache)
    ours(VarlenBatch.build([rejected], [20], [slot]), cache)
    cache.rollback(slot, 20)
    after = ours(VarlenBatch.build([accepted], [20], [slot]), cache, logits_rows="all").logits
    fresh_cache = ours.new_cache(2, 64)
    s2 = fresh_cache.allocate()
    ours(VarlenBatch.build([ids], [0], [s2]), fresh_cache)
    fresh = ours(VarlenBatch.build([accepted], [20], [s2]), fresh_cache, logits_rows="all").logits
    assert torch.equal(after, fresh)
    with pytest.raises(ValueError):
        cache.rollback(slot, 99)


def test_captured_layers_are_decoder_outputs(pair):
    hf, ours = pair
    ids = torch.randint(0, 96, (12,)).tolist()
    out = ours(VarlenBatch.build([ids], [0]), None, capture_layers=(0, 1), logits_rows=None)
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [emb, layer0, ...; last is normed]
    d = ours.config.hidden_size
    assert out.features.shape == (12, 2 * d)
    assert (out.features[:, :d] - hs[1][0]).abs().max() <= TOL
    assert (out.features[:, d:] - hs[2][0]).abs().max() <= TOL


def test_hf_dir_tokenizer_and_chat_template(tmp_path):
    hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path)
    write_tiny_tokenizer(tmp_path, hf.config.vocab_size)
    tok = load_model(str(tmp_path)).tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "w10 w11"}])
    assert ids == [3, 10, 11, 1, 2]
    assert tok.decode([10, 11]) == "w10 w11"
