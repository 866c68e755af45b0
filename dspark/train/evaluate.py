"""Stage 3: acceptance length per dataset, per-position acceptance, confidence quality.

Target in the loop, chain drafting with the full block verified every step (FixedDraftLen(gamma)),
at temperature 0 and 1, on the evaluation prompts (first turn) vendored under datasets/eval.
For DSpark also: AUROC and ECE per position before and after STS, and reliability diagrams.

    python -m dspark.train.evaluate --drafters drafters/smollm2-135m/dspark drafters/smollm2-135m/dflash \
        --out runs/eval --prompts-per-dataset 8 --max-tokens 96
"""
from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dspark.device import add_device_flag, device_or_exit
from dspark.models.loader import DEFAULT_MODEL, load_model
from dspark.sampling import SamplingParams
from dspark.sched.calibration import apply_sts
from dspark.sched.metrics import per_position_calibration, plot_reliability, prefix_survival_pairs
from dspark.speculative.engine import SpecEngine
from dspark.speculative.metrics import SpecMetrics
from dspark.speculative.policy import FixedDraftLen

EVAL_DIR = Path(__file__).resolve().parents[2] / "datasets" / "eval"  # vendored with its license
DATASETS = ["gsm8k", "humaneval", "math500", "mbpp", "mt-bench"]


def load_eval_prompts(name: str, limit: int, eval_dir: Path = EVAL_DIR) -> list[str]:
    lines = (eval_dir / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines[:limit]]


@dataclass
class Run:
    """Everything measured for one drafter on one prompt set at one temperature."""
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    conf_logits: list = field(default_factory=list)  # [gamma] raw confidence logits per verified block
    accepted: list = field(default_factory=list)
    verified: list = field(default_factory=list)

    def add(self, other: Run) -> None:
        """Pool another run's blocks into this one (several prompt sets or temperatures)."""
        self.metrics = self.metrics.merge(other.metrics)
        self.conf_logits += other.conf_logits
        self.accepted += other.accepted
        self.verified += other.verified


def run_drafter(model, drafter, prompts: list[list[int]], temperature: float, max_tokens: int,
                batch: int = 8, seed: int = 0, progress=None) -> Run:
    """Generate every prompt with the drafter in the loop; collect metrics and confidence labels."""
    engine = SpecEngine(model, drafter, FixedDraftLen(drafter.gamma), max_batch=batch, max_len=2048)
    run = Run()
    seqs = [engine.add(p, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i))
            for i, p in enumerate(prompts)]
    while engine.has_work():
        events = engine.step()
        report = engine.last_report
        if report.conf_logits is not None:
            run.conf_logits.extend(report.conf_logits.float().tolist())
            run.accepted.extend(report.accepted)
            run.verified.extend(report.verified)
        if progress:
            progress(sum(len(t) for _, t in events))
    for s in seqs:
        run.metrics = run.metrics.merge(s.spec.metrics)
    return run


def confidence_quality(run: Run, temperatures: np.ndarray | None) -> dict:
    """Per-position ECE / AUROC of the prefix survival, raw and after STS."""
    if not run.conf_logits:
        return {}
    z = np.asarray(run.conf_logits, dtype=np.float64)
    acc, ver = np.asarray(run.accepted), np.asarray(run.verified)
    out = {}
    for name, temps in (("raw", None), ("sts", temperatures)):
        if name == "sts" and temps is None:
            continue
        conf = apply_sts(z, temps) if temps is not None else 1 / (1 + np.exp(-z))
        cal = per_position_calibration(conf, acc, ver)
        out[name] = dict(ece=[float(x) for x in cal.ece], auroc=[float(x) for x in cal.auroc],
                         count=[int(x) for x in cal.count], mean_ece=float(cal.mean_ece))
    return out


def main(argv=None):
    from dspark.drafters.lookup import LookupDrafter
    from dspark.drafters.shipped import load_drafter_for

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--drafters", nargs="+", required=True, help="checkpoint directories (or shipped kinds)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--datasets", nargs="+", default=DATASETS)
    ap.add_argument("--prompts-per-dataset", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lookup", default="off", choices=["off", "on", "both"],
                    help="also (or only) each drafter behind prompt lookup, as '<kind>+lookup' "
                         "(dspark/drafters/lookup.py)")
    ap.add_argument("--eval-dir", type=Path, default=EVAL_DIR, help="folder of <dataset>.jsonl eval prompts")
    add_device_flag(ap)
    args = ap.parse_args(argv)

    loaded = load_model(args.model, device=device_or_exit(args.device, "evaluate"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = {d: [loaded.tokenizer.encode_chat([{"role": "user", "content": p}])
                   for p in load_eval_prompts(d, args.prompts_per_dataset, args.eval_dir)] for d in args.datasets}
    # Drafters can be evaluated in separate runs into one --out: results accumulate per drafter.
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    variants = {"off": [False], "on": [True], "both": [False, True]}[args.lookup]
    runs = len(args.drafters) * len(variants) * len(args.temperatures)
    total = runs * sum(len(p) for p in prompts.values()) * args.max_tokens
    bar = tqdm(total=total, desc="eval", unit="tok")
    reliability = {}
    for path, lookup in itertools.product(args.drafters, variants):
        module = load_drafter_for(loaded, path)
        temps = _load_temperatures(Path(path))
        name = f"{module.kind}{'+lookup' if lookup else ''}"
        for temperature in args.temperatures:
            drafter = LookupDrafter(module) if lookup else module  # lookup's statistics start afresh
            combined = Run()
            for dataset, ps in prompts.items():
                run = run_drafter(loaded.model, drafter, ps, temperature, args.max_tokens, args.batch,
                                  progress=bar.update)
                results[f"{name}|{temperature}|{dataset}"] = dict(
                    tau=run.metrics.acceptance_length, conditional=run.metrics.conditional_acceptance(),
                    drafts=run.metrics.drafts, accepted=run.metrics.accepted_tokens)
                combined.add(run)
            entry = dict(tau=combined.metrics.acceptance_length, conditional=combined.metrics.conditional_acceptance(),
                         drafts=combined.metrics.drafts, accepted=combined.metrics.accepted_tokens)
            entry["confidence"] = confidence_quality(combined, temps)
            results[f"{name}|{temperature}|all"] = entry
            if combined.conf_logits:
                z = np.asarray(combined.conf_logits)
                acc, ver = np.asarray(combined.accepted), np.asarray(combined.verified)
                reliability[f"{name} T={temperature} raw"] = prefix_survival_pairs(1 / (1 + np.exp(-z)), acc, ver)[:2]
                if temps is not None:
                    reliability[f"{name} T={temperature} STS"] = prefix_survival_pairs(apply_sts(z, temps), acc, ver)[:2]
        results_path.write_text(json.dumps(results, indent=1))
    bar.close()
    if reliability:
        plot_reliability(reliability, out / "reliability.png", title="Prefix survival: predicted vs observed")
    _print_and_plot(results, args, out)


def _load_temperatures(path: Path) -> np.ndarray | None:
    cal = path / "calibration.json"
    return np.asarray(json.loads(cal.read_text())["temperatures"]) if cal.exists() else None


def _print_and_plot(results: dict, args, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({k.split("|")[0] for k in results
                    if all(f"{k.split('|')[0]}|{t}|{d}" in results for t in args.temperatures for d in args.datasets)})
    lines = []
    for t in args.temperatures:
        lines.append(f"\nAcceptance length tau (block verified in full), temperature {t}")
        lines.append(f"{'drafter':<10}" + "".join(f"{d:>11}" for d in args.datasets) + f"{'mean':>9}")
        for k in kinds:
            taus = [results[f"{k}|{t}|{d}"]["tau"] for d in args.datasets]
            lines.append(f"{k:<10}" + "".join(f"{x:>11.2f}" for x in taus) + f"{np.mean(taus):>9.2f}")
        means = {k: np.mean([results[f"{k}|{t}|{d}"]["tau"] for d in args.datasets]) for k in kinds}
        for base in ("dflash", "eagle3"):
            if "dspark" in means and base in means:
                lines.append(f"DSpark / {base}: {means['dspark'] / means[base]:.3f}")
    text = "\n".join(lines)
    print(text)
    (out / "tau_table.txt").write_text(text + "\n")

    fig, axes = plt.subplots(1, len(args.temperatures), figsize=(5 * len(args.temperatures), 4), squeeze=False)
    for ax, t in zip(axes[0], args.temperatures):
        for k in kinds:
            cond = results[f"{k}|{t}|all"]["conditional"]
            ax.plot(range(1, len(cond) + 1), cond, marker="o", label=k)
        ax.set_xlabel("draft position k")
        ax.set_ylabel("P(accept k | 1..k-1 accepted)")
        ax.set_title(f"Per-position conditional acceptance, T={t}")
        ax.set_ylim(0, 1)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "per_position_acceptance.png", dpi=120)


if __name__ == "__main__":
    main()
