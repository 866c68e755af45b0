"""A new request reuses the keys/values a freed KV slot still holds for the start of its prompt (a
shared system prompt, a conversation's earlier turns): the same outputs, the same drafter features,
and the slots keep what a later request may resume."""
from __future__ import annotations

import pytest
import torch

from dspark.engine.generate import Engine
from dspark.models.kv_cache import KVCache
from dspark.sampling import SamplingParams
from dspark.speculative.engine import SpecEngine
from dspark.speculative.policy import FixedDraftLen
from tests.spec_helpers import random_drafter, tiny_target


def filled_cache(slots=4):
    cache = KVCache(num_layers=2, max_slots=slots, max_len=32, num_kv_heads=1, head_dim=2)
    for layer in cache.k + cache.v:
        layer.copy_(torch.randn_like(layer))
    return cache


def test_a_slot_that_holds_the_whole_prefix_is_taken_itself():
    cache = filled_cache()
    slot = cache.allocate()
    cache.free(slot, [5, 6, 7])
    taken, n, source = cache.allocate_reusing([5, 6, 7, 8, 9], limit=4)
    assert (taken, n, source) == (slot, 3, slot)
    assert cache.lengths[taken] == 3


def test_a_partial_match_is_copied_so_the_longer_history_stays():
    cache = filled_cache()
    history = cache.allocate()
    cache.free(history, [1, 2, 3, 4, 5, 6])
    taken, n, source = cache.allocate_reusing([1, 2, 3, 9], limit=3)
    assert source == history and taken != history and n == 3
    for layer in cache.k + cache.v:
        assert torch.equal(layer[taken, :, :3], layer[history, :, :3])
    # The history is still there for the request that resumes it.
    again, n, source = cache.allocate_reusing([1, 2, 3, 4, 5, 6, 7], limit=6)
    assert (again, n, source) == (history, 6, history)


def test_the_limit_the_longest_match_and_a_plain_allocation():
    cache = filled_cache()
    a, b = cache.allocate(), cache.allocate()
    cache.free(a, [1, 2])
    cache.free(b, [1, 2, 3, 4])
    assert cache.allocate_reusing([1, 2, 3, 4], limit=3)[1:] == (3, b)
    assert cache.allocate_reusing([7, 2], limit=1)[1:] == (0, None)  # no match: nothing reused
    cache = filled_cache(slots=1)
    slot = cache.allocate()
    cache.free(slot, [1, 2, 3])
    assert cache.allocate() == slot  # whoever takes a slot plainly writes over what it held
    cache.free(slot)
    assert cache.allocate_reusing([1, 2, 3, 4], limit=3)[1:] == (0, None)


def chat_turns(tokenizer, questions, answers=None):
    turns = []
    for i, q in enumerate(questions):
        messages = [{"role": "user", "content": q}]
        if answers is not None:
            messages += [{"role": "assistant", "content": tokenizer.decode(answers[i])},
                         {"role": "user", "content": "Say more."}]
        turns.append(tokenizer.encode_chat(messages))
    return turns


def record_admissions(engine) -> list[int]:
    """The tokens each admitted sequence starts with cached (what it reused), in order."""
    reused, admit = [], engine.scheduler.admit

    def recording():
        admitted = admit()
        reused.extend(seq.cached for seq in admitted)
        return admitted

    engine.scheduler.admit = recording
    return reused


def one_at_a_time(engine, prompts, params):
    seqs = []
    for prompt in prompts:
        seqs.append(engine.add(prompt, params))
        while engine.has_work():
            engine.step()
    return seqs


QUESTIONS = ["What is 7 times 8?", "Name a prime number above 20.", "Write a Python function that adds two numbers."]


@pytest.mark.parametrize("speculative", [False, True])
def test_greedy_output_is_the_same_with_the_system_prompt_and_earlier_turns_reused(smollm2, speculative):
    """The real target (and its shipped drafter with prompt lookup): first turns share the chat
    template's system prompt, second turns start with their whole first turn."""
    from dspark.drafters.lookup import LookupDrafter
    from dspark.drafters.shipped import load_drafter_for

    def engine(reuse):
        if not speculative:
            return Engine(smollm2.model, max_batch=4, max_len=512, reuse_prefixes=reuse)
        drafter = LookupDrafter(load_drafter_for(smollm2, "dspark", smollm2.model.precision))
        return SpecEngine(smollm2.model, drafter, FixedDraftLen(3), max_batch=4, max_len=512, reuse_prefixes=reuse)

    params = SamplingParams(max_tokens=24, temperature=0.0)
    fresh, reusing = engine(False), engine(True)
    reused = record_admissions(reusing)
    first = chat_turns(smollm2.tokenizer, QUESTIONS)
    expected = [s.output for s in one_at_a_time(fresh, first, params)]
    got = one_at_a_time(reusing, first, params)
    assert [s.output for s in got] == expected
    assert got[0].prefix_source is None and all(s.prefix_source is not None for s in got[1:])
    system = next(i for i in range(min(map(len, first))) if len({p[i] for p in first}) > 1)
    assert reused == [0] + [system] * (len(first) - 1)  # the chat template's system prompt
    second = chat_turns(smollm2.tokenizer, QUESTIONS, expected)
    expected = [s.output for s in one_at_a_time(fresh, second, params)]
    got = one_at_a_time(reusing, second, params)
    assert [s.output for s in got] == expected
    # Each second turn took up its own first turn, which the copies of the system prompt left in place.
    assert all(n > len(prompt) for n, prompt in zip(reused[len(first):], first))


def test_the_drafter_gets_the_same_features_and_seeded_samples_replay():
    target = tiny_target()
    drafter = random_drafter(target, "dspark")
    prefix = [3, 9, 4, 1, 7, 7, 2, 5, 8, 6, 1, 2]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=11)

    def run(reuse):
        engine = SpecEngine(target, drafter, FixedDraftLen(3), max_batch=2, max_len=128, reuse_prefixes=reuse)
        one_at_a_time(engine, [prefix + [10, 11]], params)
        seq = engine.add(prefix + [12, 13, 14], params)
        engine.step()  # the prefill: the prefix's features logged (reused) or made (not)
        assert engine.last_report.prefix_reused == (len(prefix) if reuse else 0)  # the verifier's metric counts it
        features = seq.spec.features(0, seq.cached).clone()
        while engine.has_work():
            engine.step()
        return seq, features

    plain, plain_features = run(False)
    reused, reused_features = run(True)
    assert reused.prefix_source is not None and plain.prefix_source is None
    assert torch.equal(reused_features, plain_features)
    assert reused.output == plain.output
