"""Speed of two checkouts side by side, in one run: did a change (a refactor) cost speed?

    python benchmarks/compare_trees.py --before /path/to/old/checkout [--after .] [--rounds 3]

Runs the user-facing commands of each tree in turn, round after round (so drift and background
load hit both alike), through their command lines only, so any two versions compare:
  in-process   python -m dspark.generate  (shipped DSpark drafter; and --drafter none: plain)
  services     python -m dspark.local     (the README's main command: three services)
and prints tokens/s per tree (median of rounds) and after / before; writes a JSON and a PNG.
Both trees run with this interpreter; each is put first on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Write a Python function that checks whether a number is prime, and explain it."
RATE = re.compile(r"= ([0-9.]+) tokens/s")

CASES = {
    "in-process DSpark": ["-m", "dspark.generate", "--max-tokens", "{tokens}", "--drafter", "dspark", PROMPT],
    "in-process plain": ["-m", "dspark.generate", "--max-tokens", "{tokens}", "--drafter", "none", PROMPT],
    "services (README main command)": ["-m", "dspark.local", "--max-tokens", "{tokens}", "--prompt", PROMPT],
}


def tokens_per_s(tree: Path, argv: list[str], tokens: int) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(tree / "client")]))
    args = [a.replace("{tokens}", str(tokens)) for a in argv]
    out = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    found = RATE.findall(out.stdout)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"{tree}: {' '.join(args)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return float(found[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, default=REPO)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "compare_trees")
    args = ap.parse_args(argv)

    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    rates = {case: {name: [] for name in trees} for case in args.cases}
    for r in range(args.rounds):
        for case in args.cases:
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]  # alternate who goes first
            for name in order:
                rate = tokens_per_s(trees[name], CASES[case], args.tokens)
                rates[case][name].append(rate)
                print(f"round {r + 1}/{args.rounds}  {case:32s} {name:6s} {rate:6.1f} tokens/s", flush=True)

    print("\n| case | before tokens/s | after tokens/s | after / before |\n|---|---|---|---|")
    summary = {}
    for case, by_tree in rates.items():
        before, after = statistics.median(by_tree["before"]), statistics.median(by_tree["after"])
        summary[case] = dict(before=by_tree["before"], after=by_tree["after"], ratio=after / before)
        print(f"| {case} | {before:.1f} | {after:.1f} | {after / before:.2f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(dict(trees={k: str(v) for k, v in trees.items()},
                                                             rounds=args.rounds, tokens=args.tokens,
                                                             results=summary), indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(REPO / "benchmarks"))
    from plotting import grouped_bars, save_figure

    fig, ax = plt.subplots(figsize=(7, 3.5))
    medians = {name: [statistics.median(rates[c][name]) for c in args.cases] for name in trees}
    grouped_bars(ax, list(args.cases), medians)
    ax.set_ylabel("tokens/s")
    ax.set_title("Two checkouts side by side (median of rounds)")
    save_figure(fig, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.json')} and .png")


if __name__ == "__main__":
    main()
