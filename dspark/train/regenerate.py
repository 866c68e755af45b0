"""Regenerate responses to the prompt corpus with the target; save token ids only.

Every record gets the target's own answer, mostly with the paper's sampling settings
(T 0.7, top-p 0.8, top-k 20) and a share greedy, decoded batched on the fast engine.
Multi-turn records are answered turn by turn (each follow-up is appended to the conversation
the target itself produced). An answer that falls into a loop is cut once its recent window is
mostly repeats (finish "loop", dspark/train/repetition.py) and ends its record. Saved per record: for each turn
the ids fed before the answer
(chat template + user text), the answer's ids and why it stopped, plus the sampling
settings; concatenating prompt_ids + response_ids over the turns gives the whole sequence.

No hidden states are cached: training runs the target teacher-forced on these ids inside its
loop (a prefill is far cheaper than the decoding done here), so the data stays a few MB.

Output: append-only shards OUT/shard_NNNNN.jsonl.gz, each written atomically every
--shard-size finished records or --checkpoint-minutes; a restart skips every id already in
a shard. Progress lines give the rate and the ETA.

    OMP_NUM_THREADS=1 python -m dspark.train.regenerate --prompts datasets/train/prompts.jsonl.gz \
        --out /work/dspark-data/regen --precision auto
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import time
from pathlib import Path

from dspark.engine.generate import Engine
from dspark.models.loader import load_model
from dspark.models.precision import add_precision_flag, resolve_precision
from dspark.models.threads import configure_threads
from dspark.sampling import SamplingParams
from dspark.train.corpus.build import read_jsonl
from dspark.train.repetition import is_looping

# DESIGN.md 1.2: the paper's reference sampling settings for regenerated responses.
REFERENCE_SAMPLING = dict(temperature=0.7, top_p=0.8, top_k=20)
SENTINEL = "\x00ANSWER\x00"


def sampling_for(record_id: str, index: int, seed: int, greedy_share: float, max_tokens: int) -> dict:
    """The record's sampling settings, a pure function of its id (same on every restart)."""
    greedy = random.Random(f"{seed}:{record_id}").random() < greedy_share
    settings = dict(temperature=0.0, top_p=1.0, top_k=0) if greedy else dict(REFERENCE_SAMPLING)
    return dict(settings, seed=seed * 1_000_003 + index, max_tokens=max_tokens)


def follow_up_ids(tokenizer, user_text: str, answer_ended_with: str | None) -> list[int]:
    """Ids that continue a conversation after an answer: end of the answer's turn, the user's
    turn, the assistant header. answer_ended_with: the text of the answer's stop token, which is
    already in the sequence (None when the answer was cut by length)."""
    messages = [{"role": "user", "content": "-"}, {"role": "assistant", "content": SENTINEL},
                {"role": "user", "content": user_text}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    glue = text[text.index(SENTINEL) + len(SENTINEL):]
    if answer_ended_with and glue.startswith(answer_ended_with):
        glue = glue[len(answer_ended_with):]
    return tokenizer.tok.encode(glue, add_special_tokens=False).ids


def done_ids(out: Path) -> set[str]:
    return {r["id"] for shard in sorted(out.glob("shard_*.jsonl.gz")) for r in read_jsonl(shard)}


def response_tokens_in(out: Path) -> int:
    return sum(len(t["response_ids"]) for shard in sorted(out.glob("shard_*.jsonl.gz"))
               for r in read_jsonl(shard) for t in r["turns"])


def write_shard(out: Path, records: list[dict]) -> Path:
    index = len(list(out.glob("shard_*.jsonl.gz")))
    path = out / f"shard_{index:05d}.jsonl.gz"
    tmp = out / f".{path.name}.tmp"
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        for r in records:
            gz.write((json.dumps(r, separators=(",", ":")) + "\n").encode())
    tmp.rename(path)  # atomic: a shard is either whole or absent
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default="datasets/train/prompts.jsonl.gz")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=512, help="per answer")
    ap.add_argument("--max-prompt-tokens", type=int, default=768, help="longer first turns are skipped")
    ap.add_argument("--max-len", type=int, default=2048, help="context per conversation")
    ap.add_argument("--greedy-share", type=float, default=0.2)
    ap.add_argument("--target-tokens", type=int, default=2_000_000, help="for the ETA line; the job runs on")
    ap.add_argument("--shard-size", type=int, default=64, help="finished records per shard")
    ap.add_argument("--checkpoint-minutes", type=float, default=5.0)
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts (0 = all)")
    ap.add_argument("--seed", type=int, default=0)
    add_precision_flag(ap)
    args = ap.parse_args(argv)
    threads = configure_threads()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = read_jsonl(Path(args.prompts))
    if args.limit:
        prompts = prompts[:args.limit]
    loaded = load_model(args.model, precision=args.precision)
    tok = loaded.tokenizer
    precision = resolve_precision(args.precision)
    (out / "meta.json").write_text(json.dumps(dict(
        target=loaded.name, precision=precision, prompts=str(args.prompts),
        reference_sampling=REFERENCE_SAMPLING, greedy_share=args.greedy_share, max_new_tokens=args.max_new_tokens,
        max_len=args.max_len, seed=args.seed), indent=1))

    done = done_ids(out)
    previous_tokens = response_tokens_in(out)
    todo = [(i, r) for i, r in enumerate(prompts) if r["id"] not in done]
    print(f"{len(prompts)} prompts, {len(done)} done ({previous_tokens} response tokens), {len(todo)} to go; "
          f"batch {args.batch}, precision {precision}, {threads} thread(s)", flush=True)

    engine = Engine(loaded.model, max_batch=args.batch, max_len=args.max_len)
    state = {}  # req_id -> (record being built, its prompt record)
    # Feed the engine lazily so memory holds only what runs, and restarts re-admit in corpus order.
    pending = iter(todo)

    def admit_next() -> bool:
        for i, prompt in pending:
            ids = tok.encode_chat([{"role": "user", "content": prompt["turns"][0]}])
            if len(ids) > args.max_prompt_tokens:
                continue
            sampling = sampling_for(prompt["id"], i, args.seed, args.greedy_share, args.max_new_tokens)
            # The precision per record: a resume on another CPU may pick other kernels under "auto".
            rec = dict(id=prompt["id"], source=prompt["source"], category=prompt["category"], sampling=sampling,
                       precision=precision, turns=[])
            start_turn(rec, prompt, ids, [])
            return True
        return False

    def start_turn(rec, prompt, prompt_ids, history):
        s = rec["sampling"]
        room = args.max_len - len(history) - len(prompt_ids) - 1
        params = SamplingParams(temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"],
                                seed=s["seed"] + 7919 * len(rec["turns"]), max_tokens=min(s["max_tokens"], room))
        seq = engine.add(history + prompt_ids, params)
        rec["turns"].append(dict(prompt_ids=prompt_ids))
        state[seq.req_id] = (rec, prompt)

    for _ in range(args.batch * 2):  # a queue a little deeper than the batch keeps every slot busy
        if not admit_next():
            break
    finished, written, new_tokens = [], len(done), 0
    t0 = last_report = last_shard = time.time()
    while engine.has_work():
        for seq, new in engine.step():
            new_tokens += len(new)
            looping = not seq.done and len(seq.output) % 16 == 0 and is_looping(seq.output)
            if looping:
                engine.abort(seq)  # frees the slot; the record ends here, loop and all
            if not seq.done:
                continue
            rec, prompt = state.pop(seq.req_id)
            rec["turns"][-1].update(response_ids=list(seq.output), finish="loop" if looping else seq.finish.value)
            k = len(rec["turns"])
            if k < len(prompt["turns"]) and not looping:
                stop_text = tok.tok.id_to_token(seq.output[-1]) if seq.finish.value == "stop" else None
                glue = follow_up_ids(tok, prompt["turns"][k], stop_text)
                if len(seq.tokens) + len(glue) + 64 < args.max_len:
                    start_turn(rec, prompt, glue, list(seq.tokens))
                    continue
            finished.append(rec)
            admit_next()
        now = time.time()
        if finished and (len(finished) >= args.shard_size or now - last_shard >= 60 * args.checkpoint_minutes
                         or not engine.has_work()):
            write_shard(out, finished)
            written += len(finished)
            finished, last_shard = [], now
        if now - last_report >= 60 or not engine.has_work():
            rate = new_tokens / (now - t0)
            total = previous_tokens + new_tokens
            left_records = len(prompts) - written - len(finished)
            per_record = total / max(1, written + len(finished))
            eta_target = max(0, args.target_tokens - total) / max(rate, 1e-9) / 3600
            eta_all = left_records * per_record / max(rate, 1e-9) / 3600
            print(f"{time.strftime('%H:%M:%S')} records {written}/{len(prompts)} saved | response tokens {total} "
                  f"({per_record:.0f}/record) | {rate:.1f} tok/s | ETA {args.target_tokens // 1000}k tokens "
                  f"{eta_target:.1f} h, all prompts {eta_all:.1f} h", flush=True)
            last_report = now
    print(f"done: {written} records in {out}", flush=True)


if __name__ == "__main__":
    main()
