"""Magpie-style user queries: the target itself writes them.

Feed the chat template up to the start of a user turn and let the target sample; what it
writes before its end-of-turn token is a plausible user query. System prompts steer the
domain (a coding assistant's users ask for code). Raw samples are appended to a jsonl file,
so an interrupted run resumes; filters.good_user_query and dedup run later in build.py.

    python -m dspark.train.corpus.magpie --out /work/dspark-data/magpie_raw.jsonl --count 3000
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dspark.engine.generate import Engine
from dspark.models.loader import load_model
from dspark.models.precision import add_precision_flag
from dspark.models.threads import configure_threads
from dspark.sampling import SamplingParams

# (category, system prompt): None keeps the template's own default system prompt.
SYSTEM_PROMPTS = [
    ("chat", None),
    ("chat", "You are a friendly assistant who answers everyday questions."),
    ("writing", "You are a writing assistant. Users ask you to write stories, poems, emails and essays."),
    ("code", "You are an expert Python programmer. Users ask you to write and fix code."),
    ("code", "You are a programming assistant for JavaScript, C, Java, Rust, Go and SQL."),
    ("math", "You are a math tutor. Users ask you to solve word problems step by step."),
    ("reasoning", "You are a helpful assistant who explains science, history and logic puzzles."),
    ("instructions", "You are an assistant that follows detailed formatting instructions exactly."),
]
SENTINEL = "\x00USER\x00"


def user_turn_prefix(tokenizer, system: str | None) -> str:
    """The rendered chat up to where the user's words begin."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": SENTINEL}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    return text[:text.index(SENTINEL)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=3000, help="raw samples wanted in --out in total")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.98)
    ap.add_argument("--seed", type=int, default=1234)
    add_precision_flag(ap)
    args = ap.parse_args(argv)
    configure_threads()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {json.loads(line)["i"] for line in out.open()} if out.exists() else set()
    loaded = load_model(args.model, precision=args.precision)
    tok = loaded.tokenizer
    prefixes = [(cat, tok.tok.encode(user_turn_prefix(tok, system), add_special_tokens=False).ids)
                for cat, system in SYSTEM_PROMPTS]
    engine = Engine(loaded.model, max_batch=args.batch,
                    max_len=max(len(p) for _, p in prefixes) + args.max_new_tokens + 1)
    category_of = {}
    todo = [i for i in range(args.count) if i not in done]
    for i in todo:
        cat, prefix = prefixes[i % len(prefixes)]
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_new_tokens,
                                seed=args.seed * 1_000_003 + i)
        category_of[engine.add(prefix, params).req_id] = (i, cat, len(prefix))
    t0, tokens, written = time.time(), 0, 0
    with out.open("a") as f:
        while engine.has_work():
            for seq, new in engine.step():
                tokens += len(new)
                if not seq.done:
                    continue
                i, cat, _ = category_of[seq.req_id]
                text = tok.decode(seq.output, skip_special_tokens=True).strip()
                f.write(json.dumps(dict(i=i, category=cat, finish=seq.finish.value, text=text)) + "\n")
                f.flush()
                written += 1
                if written % 100 == 0:
                    rate = written / (time.time() - t0)
                    print(f"magpie {len(done) + written}/{args.count} samples, {tokens / (time.time() - t0):.0f} tok/s, "
                          f"ETA {(len(todo) - written) / rate / 60:.1f} min", flush=True)
    print(f"magpie done: {len(done) + written} samples in {out}")


if __name__ == "__main__":
    main()
