"""The committed prompt corpus and the pieces that build it: eval decontamination, dedup, filters."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from dspark.train.corpus.build import read_jsonl
from dspark.train.corpus.dedup import deduplicate
from dspark.train.corpus.eval_overlap import EVAL_DIR, eval_grams, eval_texts, grams, overlaps
from dspark.train.corpus.filters import good_user_query
from dspark.train.corpus.templates import template_prompts

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "datasets" / "train" / "prompts.jsonl.gz"


def test_committed_corpus_shares_no_13gram_with_any_eval_file():
    corpus = read_jsonl(CORPUS)
    per_file = {name: {g for t in texts for g in grams(t)} for name, texts in eval_texts().items()}
    assert set(per_file) == {"gsm8k.jsonl", "humaneval.jsonl", "math500.jsonl", "mbpp.jsonl", "mt-bench.jsonl"}
    for name, index in per_file.items():
        assert index, name
        hits = [r["id"] for r in corpus if overlaps("\n".join(r["turns"]), index)]
        assert not hits, f"{len(hits)} prompts share a 13-gram with {name}: {hits[:5]}"


def test_committed_corpus_size_mix_and_ids():
    corpus = read_jsonl(CORPUS)
    assert len(corpus) >= 20_000
    assert len({r["id"] for r in corpus}) == len(corpus)
    assert len({"\n".join(r["turns"]) for r in corpus}) == len(corpus)
    cats = Counter(r["category"] for r in corpus)
    for cat in ("chat", "writing", "reasoning", "math", "code", "instructions", "multi-turn"):
        assert cats[cat] >= 500, cats
    sources = Counter(r["source"] for r in corpus)
    assert {"templates", "magpie", "docstrings", "man_pages", "package_docs"} <= set(sources), sources
    assert all(len(r["turns"]) >= 2 for r in corpus if r["category"] == "multi-turn")


def test_overlap_check_catches_a_planted_eval_span():
    turn = next(t for t in eval_texts()["gsm8k.jsonl"] if len(t.split()) > 20)
    span = " ".join(turn.split()[3:16])  # 13 words from inside an eval prompt
    index = eval_grams(EVAL_DIR)
    assert overlaps(f"Please help me with this: {span.upper()} thanks", index)
    assert not overlaps("Write a haiku about a quiet harbor at dawn, with no rhymes at all please.", index)


def test_dedup_drops_exact_and_near_duplicates_but_keeps_distinct_prompts():
    base = ("Write a Python function that merges two sorted lists into one sorted list, keeps duplicates, runs in "
            "linear time and returns a new list without changing its inputs.")
    records = [dict(turns=[base]), dict(turns=[base.upper() + "!!"]),  # exact after normalization
               dict(turns=[base + " Thanks a lot."]),  # near duplicate: Jaccard of 5-word shingles 0.89
               dict(turns=["Explain how tides are caused by the Moon and the Sun, for a ten-year-old."]),
               dict(turns=["Write a Rust function that merges two sorted vectors."])]
    kept = deduplicate(records)
    assert [r["turns"][0] for r in kept] == [base, records[3]["turns"][0], records[4]["turns"][0]]


def test_template_prompts_are_varied_and_deterministic():
    a, b = template_prompts(2000, seed=1), template_prompts(2000, seed=1)
    assert a == b
    assert len(deduplicate(a)) > 1500
    assert all("{" not in t or "```" in t or "boxed" in t for r in a for t in r["turns"])  # no unfilled slots


def test_user_query_filter():
    assert good_user_query("Can you explain how a binary search works and when I should use it?")
    assert not good_user_query("the the the the the the the the the the the the the the")
    assert not good_user_query("Was ist der Unterschied zwischen einer Liste und einem Tupel?")
    assert not good_user_query("Hi<|im_end|> there, what is the capital of France?")
    assert not good_user_query("short?")


def test_append_keeps_existing_ids_and_adds_only_new_prompts(tmp_path):
    from dspark.train.corpus import build

    out = tmp_path / "prompts.jsonl.gz"
    none = ["--docstrings", "0", "--man-pages", "0", "--paragraphs", "0", "--out", str(out)]
    build.main(none + ["--templates", "40", "--seed", "1"])
    first = read_jsonl(out)
    build.main(none + ["--templates", "80", "--seed", "2", "--append"])
    second = read_jsonl(out)
    assert second[:len(first)] == first  # a running regeneration keeps its ids
    assert len(second) > len(first)
    assert len({r["id"] for r in second}) == len(second)
    assert len({"\n".join(r["turns"]) for r in second}) == len(second)
    build.main(none + ["--templates", "80", "--seed", "2", "--append"])  # the same prompts again: all duplicates
    assert read_jsonl(out) == second
