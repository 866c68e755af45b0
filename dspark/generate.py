"""Generate text in one process with the speculative engine (or plain decoding), and report speed.

    python -m dspark.generate "What is speculative decoding?"
    python -m dspark.generate --drafter none "..."        # plain decoding
"""
from __future__ import annotations

import argparse
import time

from dspark.device import add_device_flag, describe, device_or_exit
from dspark.drafters.ahead import DraftAheadThread
from dspark.drafters.lookup import LookupDrafter
from dspark.drafters.shipped import load_datastore_for, load_drafter_for
from dspark.models.loader import DEFAULT_MODEL, load_model
from dspark.models.precision import add_precision_flag
from dspark.models.threads import configure_threads
from dspark.sampling import SamplingParams
from dspark.speculative.engine import SpecEngine
from dspark.speculative.policy import FixedDraftLen


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt", nargs="*", default=["Explain speculative decoding in two sentences."])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--drafter", default="dspark", help="dspark | dflash | eagle3 | none | a checkpoint directory")
    ap.add_argument("--draft-len", type=int, default=None,
                    help="draft tokens verified per request per step (default: the block size)")
    ap.add_argument("--lookup", default="on", choices=["on", "off"],
                    help="prompt lookup in front of the drafter (dspark/drafters/lookup.py)")
    ap.add_argument("--datastore", default="auto",
                    help="with --lookup on: lookup in the target's own answers too (dspark/drafters/datastore.py); "
                         "auto: the shipped one, off, or a datastore file")
    ap.add_argument("--draft-ahead", default="off", choices=["on", "off"],
                    help="on: the drafter drafts the next block on a thread of its own while the target verifies "
                         "(dspark/drafters/ahead.py); off by default: on a 2-core CPU the thread takes a core "
                         "from the target's pass (docs/results.md)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    add_precision_flag(ap)
    add_device_flag(ap)
    args = ap.parse_args(argv)

    device = device_or_exit(args.device, "generate")
    threads = configure_threads()
    loaded = load_model(args.model, device=device, precision=args.precision)
    drafter = load_drafter_for(loaded, args.drafter, args.precision)
    if drafter is not None:
        drafter.warm_up()  # its caches built before the clock starts
    if drafter is not None and args.draft_ahead == "on" and drafter.drafts_ahead:
        drafter = DraftAheadThread(drafter)
    if drafter is not None and args.lookup == "on":
        drafter = LookupDrafter(drafter, datastore=load_datastore_for(loaded.name, args.datastore))
    print(f"[{loaded.name}: {loaded.model.precision} matmuls on {describe(device)}, {threads} CPU threads]", flush=True)
    policy = FixedDraftLen(args.draft_len if args.draft_len is not None else (drafter.gamma if drafter else 0))
    engine = SpecEngine(loaded.model, drafter, policy, max_batch=4, max_len=2048)
    prompt = loaded.tokenizer.encode_chat([{"role": "user", "content": " ".join(args.prompt)}])
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    start = time.perf_counter()
    seq = engine.add(prompt, params)
    printed = 0
    while engine.has_work():
        engine.step()
        text = loaded.tokenizer.decode(seq.output)
        print(text[printed:], end="", flush=True)
        printed = len(text)
    elapsed = time.perf_counter() - start
    m = seq.spec.metrics
    datastore = getattr(drafter, "datastore", None)
    lookup = (" + prompt lookup" if args.lookup == "on" else "") + (" + datastore" if datastore is not None else "") + (
        ", drafting ahead" if isinstance(getattr(drafter, "inner", drafter), DraftAheadThread) else "")
    label = f"{drafter.kind} drafter{lookup}" if drafter else "no drafter (plain decoding)"
    print(f"\n\n[{loaded.name}, {label}] {len(seq.output)} tokens in {elapsed:.2f}s = "
          f"{len(seq.output) / elapsed:.1f} tokens/s; acceptance length tau = {m.acceptance_length:.2f} "
          f"({m.accepted_tokens}/{m.draft_tokens} draft tokens accepted); finish: {seq.finish.value}")


if __name__ == "__main__":
    main()
