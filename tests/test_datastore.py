"""The lookup datastore (the target's own answers): longest match and most frequent continuation against
a brute-force reference, answer boundaries, save/load; behind prompt lookup, the target's output is
unchanged (greedy identical, sampled in distribution, seeded requests replay) and its guesses score
themselves."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from dspark.drafters.datastore import Datastore
from dspark.drafters.lookup import LookupDrafter
from dspark.sampling import SamplingParams
from dspark.speculative.engine import SpecEngine
from dspark.speculative.policy import FixedDraftLen
from tests.spec_helpers import greedy_reference, random_drafter, tiny_target
from tests.test_lookup import assert_first_tokens_keep_the_targets_law, assert_seeded_replay, law_target


def brute_force(answers, text, k, max_n=16):
    """(longest match n, its occurrences, guess): every place an answer's tokens end like `text`, then at
    each slot the most frequent next token among the places that agreed so far (the smallest token on a
    tie)."""
    best, places = 0, []
    for a in answers:
        for end in range(len(a)):
            m = 0
            while m < min(max_n, len(text)) and end - m >= 0 and a[end - m] == text[-1 - m]:
                m += 1
            if m > best:
                best, places = m, [(a, end)]
            elif m == best and m:
                places.append((a, end))
    occurrences = len(places)
    guess = []
    for j in range(k):
        following = Counter(a[end + 1 + j] for a, end in places if end + 1 + j < len(a))
        if not following:
            break
        token = max(sorted(following.items()), key=lambda item: item[1])[0]
        guess.append(token)
        places = [(a, end) for a, end in places if end + 1 + j < len(a) and a[end + 1 + j] == token]
    return best, occurrences, guess


@pytest.mark.parametrize("first_token", [0, 150_000])  # 4 tokens packed in a prefix key; past 55k, 3
def test_match_and_continuation_equal_a_brute_force_search(first_token):
    rng = np.random.default_rng(0)
    answers = [(first_token + rng.integers(0, 4, rng.integers(1, 40))).tolist() for _ in range(200)]
    datastore = Datastore(answers, min_n=1, max_occurrences=10**9)  # every occurrence counted, as brute force does
    for _ in range(300):
        text = (first_token + rng.integers(0, 4, rng.integers(1, 20))).tolist()
        n, occurrences, guess = brute_force(answers, text, 5)
        found, lo, hi = datastore.match(text)
        assert (found, hi - lo if found else 0) == (n, occurrences)
        assert datastore.continuation(text, 5)[0] == guess
    for text in ([first_token + 9], [first_token + 1, first_token + 9], []):  # ending in a token never seen; none
        assert datastore.match(text)[0] == 0
        assert datastore.continuation(text, 5)[0] == []


def test_shares_and_answer_ends():
    datastore = Datastore([[1, 2, 3, 4], [1, 2, 3, 5], [9, 2, 3, 4, 6], [7, 2, 3]], min_n=2)
    guess, shares, n, occurrences = datastore.continuation([8, 2, 3], 3)
    assert (n, occurrences) == (2, 4)  # (2, 3) four times; (8, 2, 3) never
    assert guess == [4, 6] and shares == [0.5, 0.5]  # 4 in two of four, then 6 after one of those two
    # An answer's end is no guess: (2, 3) at the end of [7, 2, 3] counts only as an occurrence.
    assert datastore.continuation([1, 7, 2, 3], 2)[0] == []  # (7, 2, 3) ends its answer
    # No match across two answers: [3, 4] then [1, 2] are not "4, 1".
    assert datastore.match([4, 1])[0] == 1
    assert datastore.continuation([5], 2) == ([], [], 1, 0)  # shorter than min_n: no guess


def test_save_and_load_keep_every_answer(tmp_path):
    rng = np.random.default_rng(1)
    answers = [rng.integers(0, 50, rng.integers(5, 60)).tolist() for _ in range(100)]
    datastore = Datastore(answers)
    datastore.save(tmp_path / "ds.npz")
    loaded = Datastore.load(tmp_path / "ds.npz")
    assert loaded.tokens == datastore.tokens == sum(map(len, answers))
    for a in answers[:20]:
        text = a[: len(a) // 2]
        assert loaded.continuation(text, 7) == datastore.continuation(text, 7)


def target_datastore(target, prompts, max_tokens=40):
    """A datastore of the target's own greedy answers: for other prompts' requests, a good one."""
    return Datastore([p + out for p, out in zip(prompts, greedy_reference(target, prompts, max_tokens))], min_n=2)


def prompts_for(seed, count, vocab=64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (6 + i % 4,), generator=g).tolist() for i in range(count)]


@pytest.mark.parametrize("concurrent", [1, 6])
def test_greedy_identical_with_a_datastore(concurrent):
    target = tiny_target()
    stored = prompts_for(1, 12)
    prompts = [p[:-1] for p in stored[:concurrent]]  # the stored prompts but one token: the answers differ
    datastore = target_datastore(target, stored)
    drafter = LookupDrafter(random_drafter(target, "dspark"), datastore=datastore, min_share=0.3)
    engine = SpecEngine(target, drafter, FixedDraftLen(4), max_batch=8, max_len=256)
    max_tokens = [40, 25, 33, 18, 40, 29][:concurrent]
    seqs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    for seq, m, p in zip(seqs, max_tokens, prompts):
        assert seq.output == greedy_reference(target, [p], m)[0]
    assert sum(map(sum, drafter.datastore_stats.tries)) > 0  # the datastore drafted ...
    assert sum(map(sum, drafter.datastore_stats.hits)) > 0  # ... and some of it was right


def test_a_datastore_of_other_text_changes_nothing():
    target = tiny_target()
    prompts = prompts_for(2, 4)
    rng = np.random.default_rng(3)
    noise = Datastore([rng.integers(3, 64, 200).tolist() for _ in range(50)], min_n=1)
    drafter = LookupDrafter(random_drafter(target, "dspark"), datastore=noise, min_share=0.0)
    engine = SpecEngine(target, drafter, FixedDraftLen(4), max_batch=4, max_len=256)
    seqs = engine.generate(prompts, [SamplingParams(max_tokens=30)] * len(prompts))
    assert [s.output for s in seqs] == greedy_reference(target, prompts, 30)
    assert sum(map(sum, drafter.datastore_stats.tries)) > 0


def test_sampled_first_tokens_match_plain_sampling_with_a_datastore():
    """The datastore's point-mass drafts keep the target's law."""
    target = law_target()
    datastore = Datastore([[6, 7, 1, 2, 3, 4], [6, 7, 1, 2, 5, 5], [7, 1, 2, 3]], min_n=2)
    drafter = LookupDrafter(random_drafter(target, "dspark", gamma=3, seed=6, support_size=4), datastore=datastore)
    assert_first_tokens_keep_the_targets_law(target, drafter, [1, 2, 3, 4, 5, 6, 7, 1], drafter.datastore_stats)


def test_seeded_requests_replay_with_a_datastore_whatever_runs_beside_them():
    target = tiny_target(sharpness=3.0)
    stored = prompts_for(4, 8)
    datastore = target_datastore(target, stored)
    assert_seeded_replay(target, lambda: LookupDrafter(random_drafter(target, "dspark", support_size=4),
                                                       datastore=datastore, min_share=0.3),
                         [p[:-1] for p in stored[:4]])


def test_the_builder_leaves_the_held_out_records_out(tmp_path):
    import gzip
    import json

    from dspark.train.build_datastore import conversations
    from dspark.train.regen_data import HELD_OUT_SHARE, is_held_out

    held = next(f"p{i}" for i in range(10_000) if is_held_out(f"p{i}", HELD_OUT_SHARE))
    kept = next(f"p{i}" for i in range(10_000) if not is_held_out(f"p{i}", HELD_OUT_SHARE))
    records = [{"id": rid, "turns": [{"prompt_ids": [1, 2], "response_ids": [3, 4], "finish": "stop"},
                                     {"prompt_ids": [5], "response_ids": [6, 7], "finish": "stop"}]}
               for rid in (held, kept)]
    with gzip.open(tmp_path / "shard_00000.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    assert conversations(tmp_path) == [[1, 2, 3, 4, 5, 6, 7]]  # the kept record's turns back to back


def test_load_datastore_for(tmp_path):
    from dspark.drafters.shipped import load_datastore_for

    assert load_datastore_for("smollm2-135m", "off") is None
    assert load_datastore_for("no-such-model", "auto") is None  # nothing shipped: no datastore, no error
    with pytest.raises(FileNotFoundError):
        load_datastore_for("smollm2-135m", str(tmp_path / "missing.npz"))
    Datastore([[1, 2, 3]]).save(tmp_path / "ds.npz")
    assert load_datastore_for("smollm2-135m", str(tmp_path / "ds.npz")).tokens == 3
