"""Train a DSpark, DFlash or EAGLE-3 drafter on cached target features (method.md 3).

    python -m dspark.train.trainer --config dspark/train/configs/dspark.json --data DATA --out OUT
    python -m dspark.train.trainer --config ... --regen datasets/train/regen --feature-cache CACHE --out OUT

--data reads a cached dataset (prepare.py); --regen reads the regenerated token ids and runs the
target teacher-forced for their features (kept in --feature-cache, so later passes and the other
drafters' runs read them), holding out a share of the records for the held-out loss.

Config (plain JSON): {"drafter": {DrafterConfig fields, "kind" required}, "train": {see
TrainConfig in config.py}, "target": optional model name/path for the embedding and LM head (default: the
dataset's meta.json "target")}. Everything random is seeded from (seed, step), so resuming from
a checkpoint gives the same run as never stopping.

out/: config.json, log.jsonl (one line per step), checkpoints/step_XXXXXXX/ (model + optimiser +
RNG + step), drafter/ (the final drafter, docs/drafter_format.md), loss.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from dspark.device import add_device_flag, device_or_exit
from dspark.drafters import build_drafter
from dspark.drafters.checkpoint import save_drafter
from dspark.drafters.config import DrafterConfig
from dspark.train import losses
from dspark.train.anchors import sample_anchors, sample_rows, slot_validity, ttt_validity
from dspark.train.config import TrainConfig, load_train_config
from dspark.train.dataset import CachedDataset, OnlineDataset, Sequence
from dspark.train.regen_data import HELD_OUT_SHARE, load_split


def lr_factor(step: int, t: TrainConfig) -> float:
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def choose_draft_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent token ids (ties: lower id first), in ascending id order."""
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:size].sort().values


class TargetLSE:
    """Full-vocabulary logsumexp of the target logits per position, computed on demand.

    It turns the draft-vocab slice of the target logits into exact probabilities, but costs a
    full-vocabulary LM-head pass, so only the positions a step needs are computed, in aligned
    chunks that are always computed whole: a value never depends on which step asked first.
    A dataset that stores target_lse skips all of this.
    """

    def __init__(self, lm_head: torch.Tensor, chunk: int = 64):
        self.lm_head, self.chunk, self._cache = lm_head, chunk, {}

    @torch.no_grad()
    def __call__(self, index: int, seq: Sequence, positions: torch.Tensor) -> torch.Tensor:
        device = self.lm_head.device
        if seq.target_lse is not None:
            return seq.target_lse.to(device, non_blocking=True)[positions]
        length = seq.final_hidden.shape[0]
        if index not in self._cache:
            self._cache[index] = (torch.zeros(length, device=device), [False] * -(-length // self.chunk))
        values, done = self._cache[index]
        for c in positions.div(self.chunk, rounding_mode="floor").unique().tolist():
            if not done[c]:
                rows = slice(c * self.chunk, min(length, (c + 1) * self.chunk))
                values[rows] = torch.logsumexp(seq.final_hidden[rows].to(device) @ self.lm_head.T, -1)
                done[c] = True
        return values[positions]


def crop(seq: Sequence, max_len: int, gen: torch.Generator) -> tuple[Sequence, int]:
    """A random window of at most max_len positions, and where it starts in the sequence."""
    length = seq.tokens.shape[0]
    if length <= max_len:
        return seq, 0
    s = int(torch.randint(0, length - max_len + 1, (1,), generator=gen))
    w = slice(s, s + max_len)
    lse = seq.target_lse[w] if seq.target_lse is not None else None
    return Sequence(seq.tokens[w], seq.loss_mask[w], seq.features[w], seq.final_hidden[w], lse), s


def _target_rows(drafter, seq: Sequence, lse, positions: torch.Tensor, needed: torch.Tensor):
    """p^t of the token after each position, as (p_in [.., V'], mass_out [..]).

    lse(positions) gives the full-vocabulary logsumexp; only `needed` (supervised) rows ask for it.
    """
    with torch.no_grad():
        logits = drafter.draft_logits(seq.final_hidden[positions])
        row_lse = torch.full(positions.shape, float("inf"), device=positions.device)  # rows not needed: p_in = 0
        row_lse[needed] = lse(positions[needed])
        return losses.target_probs(logits, row_lse)


def sequence_loss(drafter, seq: Sequence, lse, t: TrainConfig, budget: int, gen: torch.Generator) -> dict | None:
    """The loss terms of one sequence with at most `budget` supervised rows; None if nothing to learn.

    lse(positions) -> the target's full-vocabulary logsumexp at those positions of `seq`.
    """
    length, gamma = seq.tokens.shape[0], drafter.gamma
    if drafter.kind == "eagle3":
        steps = t.ttt_steps
        valid = ttt_validity(seq.loss_mask, steps)
        rows = sample_rows(valid, budget, gen)
        if rows.numel() == 0:
            return None
        step, pos = rows // (length - 1), rows % (length - 1)
        hidden = drafter.train_forward(seq.features, seq.tokens, steps)
        logits = drafter.draft_logits(hidden.reshape(-1, hidden.shape[-1])[rows])
        p_in, mass_out = _target_rows(drafter, seq, lse, pos + 1, torch.ones_like(pos, dtype=torch.bool))
        return losses.eagle3_loss(logits, p_in, mass_out, step, steps, t.ttt_decay)

    anchors = sample_anchors(seq.loss_mask, min(t.anchors_per_seq, max(1, budget // gamma)), gen)
    if anchors.numel() == 0:
        return None
    valid = slot_validity(anchors, seq.loss_mask, gamma)
    logits, conf = drafter.train_forward(seq.features, seq.tokens, anchors)
    slot_pos = (anchors[:, None] + torch.arange(gamma, device=anchors.device)).clamp(max=length - 1)  # hidden of a+k-1
    p_in, mass_out = _target_rows(drafter, seq, lse, slot_pos, valid)
    token_index = drafter.to_draft_index(seq.tokens[(slot_pos + 1).clamp(max=length - 1)])
    weights = losses.slot_weights(gamma, t.slot_decay, device=logits.device)
    if drafter.kind == "dflash":
        return losses.dflash_loss(logits, p_in, mass_out, token_index, valid, weights)
    return losses.dspark_loss(logits, conf, p_in, mass_out, token_index, valid, weights, t.mix)


class DataOrder:
    """Sequence index of global sample i: a fresh seeded permutation every epoch."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self._perms = n, seed, {}

    def __call__(self, i: int) -> int:
        epoch = i // self.n
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed + 7919 * epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=gen)}
        return int(self._perms[epoch][i % self.n])


# ---- checkpoints ----
def _checkpoint_dirs(out: Path) -> list[Path]:
    return sorted((out / "checkpoints").glob("step_*"))


def save_checkpoint(out: Path, step: int, drafter, optimizer, scheduler, keep: int) -> Path:
    final = out / "checkpoints" / f"step_{step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous().cpu() for k, v in drafter.state_dict().items()}, str(tmp / "model.safetensors"))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": torch.get_rng_state(), "step": step}, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)  # a checkpoint directory is either complete or absent
    for old in _checkpoint_dirs(out)[:-keep]:
        shutil.rmtree(old)
    return final


def load_checkpoint(path: Path, drafter, optimizer, scheduler) -> int:
    drafter.load_state_dict(load_file(str(path / "model.safetensors")))
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return state["step"]


def warm_start(drafter, directory: str | Path) -> None:
    """Load a saved drafter's weights into a freshly built one of the same shapes (clear error otherwise)."""
    state = load_file(str(Path(directory) / "model.safetensors"))
    own = drafter.state_dict()
    mismatched = sorted(k for k in own.keys() | state.keys()
                        if k not in own or k not in state or own[k].shape != state[k].shape)
    if mismatched:
        raise ValueError(f"--init {directory}: weights do not match this config: {', '.join(mismatched[:5])}")
    drafter.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})


def _target_weights(target, name: str):
    if target is None:
        from dspark.models.loader import load_model
        target = load_model(name).model
    return target.config, target.model.embed_tokens.weight.detach().float(), target.output_weight.detach().float()


def _mean_logs(items: list[dict]) -> dict:
    out = {}
    for key in items[0]:
        if key == "accept":
            cols = list(zip(*[it["accept"] for it in items]))
            out[key] = [float(torch.tensor(c).nanmean()) for c in cols]
        else:
            out[key] = sum(float(it[key]) for it in items) / len(items)
    return out


def sequence_to(seq: Sequence, device: torch.device) -> Sequence:
    """One training sequence on the drafter's device (the host->device copy of a step's data)."""
    return dataclasses.replace(seq, **{f.name: getattr(seq, f.name).to(device, non_blocking=True)
                                       for f in dataclasses.fields(seq) if getattr(seq, f.name) is not None})


def dataset_sequence_loss(drafter, data, index: int, lse: TargetLSE, t: TrainConfig, budget: int,
                          gen: torch.Generator, device) -> dict | None:
    """sequence_loss of data[index], cropped to max_seq_len, on the drafter's device (None: no anchor):
    the one body the training step and the held-out evaluation share."""
    raw = data[index]
    seq, offset = crop(raw, t.max_seq_len, gen)

    def seq_lse(positions):
        return lse(index, raw, positions + offset)

    with _autocast(t, device):
        return sequence_loss(drafter, sequence_to(seq, torch.device(device)), seq_lse, t, budget, gen)


@torch.no_grad()
def held_out_loss(drafter, heldout, t: TrainConfig, lse: TargetLSE, device) -> dict:
    """Mean loss and teacher-forced accepted length over the first eval_sequences held-out sequences,
    with the same anchors every time (a fixed seed), so evaluations compare across steps."""
    gen = torch.Generator().manual_seed(t.seed + 104729)
    budget = t.max_block_tokens // t.batch_sequences
    was_training = drafter.training
    drafter.eval()
    logs = []
    for index in range(min(t.eval_sequences, len(heldout))):
        result = dataset_sequence_loss(drafter, heldout, index, lse, t, budget, gen, device)
        if result is not None:
            logs.append({k: (v.item() if torch.is_tensor(v) else v) for k, v in result.items()})
    drafter.train(was_training)
    if not logs:
        return {}
    mean = _mean_logs(logs)
    return {"heldout_loss": mean["loss"], "heldout_accept_len": _accept_len(mean["accept"])} if "accept" in mean \
        else {"heldout_loss": mean["loss"]}


def _autocast(t: TrainConfig, device) -> torch.autocast:
    """bf16 matmuls in the drafter's forward and backward when train.bf16 (AMX / tensor cores);
    autocast keeps the losses' softmaxes and reductions in fp32."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=t.bf16)


def _accept_len(accept: list[float]) -> float:
    """Teacher-forced expected accepted length from per-slot acceptance: sum_k prod_{i<=k} alpha_i."""
    alphas = torch.tensor([0.0 if math.isnan(a) else a for a in accept])
    return float(alphas.cumprod(0).sum())


def train(config: str | Path | dict, data_dir: str | Path | None, out_dir: str | Path, resume: bool = True,
          target=None, dataset=None, show_progress: bool = True, stop_after: int | None = None,
          device: torch.device | str = "cpu", heldout=None, init: str | Path | None = None) -> dict:
    """Train to the step budget (resuming from out_dir's latest checkpoint); return a summary.

    target: a dspark Transformer giving the embedding / LM head (default: load config["target"]
    or the dataset's target). dataset: any object with the CachedDataset interface (default:
    CachedDataset(data_dir)). stop_after: end this run (after a checkpoint) once that many steps
    are done in total, e.g. to time-box a session; a later call resumes. device: where the
    drafter trains (the data stays on the host until its step). heldout: sequences never trained
    on (same interface as the dataset), read every train.eval_every steps for the held-out loss.
    init: a saved drafter (e.g. a shipped one) whose weights a fresh run starts from, to extend a
    budget across machines without carrying optimizer state; its shapes must match the config.
    """
    cfg = load_train_config(config)
    t = cfg["train"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = dataset if dataset is not None else CachedDataset(data_dir)
    target_cfg, embed, lm_head = _target_weights(target, cfg.get("target") or data.meta["target"])

    drafter_fields = dict(cfg["drafter"])
    kind = drafter_fields.pop("kind")
    drafter_fields.setdefault("target", data.meta["target"])
    drafter_fields.setdefault("version", f"{kind}-{t.steps}")
    dcfg = DrafterConfig.for_target(target_cfg, kind, data.ctx_layers, **drafter_fields)
    draft_vocab = None
    if init is not None and dcfg.draft_vocab_size:  # a warm start keeps the rows its weights were trained for
        draft_vocab = load_file(str(Path(init) / "model.safetensors"))["draft_vocab"]
    elif dcfg.draft_vocab_size:
        draft_vocab = choose_draft_vocab(data.token_counts(dcfg.vocab_size), dcfg.draft_vocab_size)
    torch.manual_seed(t.seed)
    drafter = build_drafter(dcfg, embed, lm_head, draft_vocab).to(device).train()
    (out / "config.json").write_text(json.dumps({**cfg, "drafter": dcfg.to_dict(), "train": t.to_dict()}, indent=2)
                                      + "\n")

    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                                  fused=True)  # one kernel: several times faster on CPU than foreach
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, t))
    step = 0
    if not resume:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    checkpoints = _checkpoint_dirs(out)
    if resume and checkpoints:
        step = load_checkpoint(checkpoints[-1], drafter, optimizer, scheduler)
    elif init is not None:
        warm_start(drafter, init)
    log_path = out / "log.jsonl"
    kept = [line for line in (log_path.read_text().splitlines() if log_path.exists() and step else [])
            if json.loads(line)["step"] <= step]
    log_path.write_text("".join(line + "\n" for line in kept))  # drop lines past the checkpoint

    lse = TargetLSE(drafter.lm_head_full)
    heldout_lse = TargetLSE(drafter.lm_head_full)
    order = DataOrder(len(data), t.seed)
    batch, budget = t.batch_sequences, t.max_block_tokens // t.batch_sequences
    n_params = sum(p.numel() for p in params)
    print(f"training {kind}: {n_params / 1e6:.1f}M parameters, draft vocab {dcfg.draft_vocab}, "
          f"{len(data)} sequences, steps {step}..{t.steps}")
    first, durations = step, []
    bar = tqdm(range(step, t.steps), initial=step, total=t.steps, disable=not show_progress)
    for step in bar:
        began = time.perf_counter()
        gen = torch.Generator().manual_seed(t.seed * 1_000_003 + step)
        optimizer.zero_grad(set_to_none=True)
        logs = []
        for b in range(batch):
            result = dataset_sequence_loss(drafter, data, order(step * batch + b), lse, t, budget, gen, device)
            if result is None:
                continue
            (result["loss"] / batch).backward()
            logs.append({k: (v.item() if torch.is_tensor(v) else v) for k, v in result.items()})
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, t.grad_clip)) if logs else 0.0
        optimizer.step()
        scheduler.step()
        seconds = time.perf_counter() - began
        record = {"step": step + 1, "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm, "seconds": seconds,
                  **(_mean_logs(logs) if logs else {})}
        if "accept" in record:
            record["accept_len"] = _accept_len(record["accept"])
        if heldout is not None and t.eval_every and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps):
            record.update(held_out_loss(drafter, heldout, t, heldout_lse, device))
        with log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        durations.append(seconds)
        if step in (first, first + 5):  # early steps also pay one-off costs (target logsumexp): an upper bound
            per_step = sum(durations[1:] or durations) / len(durations[1:] or durations)
            print(f"\n{per_step:.2f} s/step over the first {len(durations)} step(s): at most about "
                  f"{per_step * (t.steps - step - 1) / 60:.1f} min for the remaining {t.steps - step - 1} steps")
        bar.set_postfix(loss=f"{record.get('loss', float('nan')):.4f}", acc=f"{record.get('accept_len', 0):.2f}")
        stopping = stop_after is not None and step + 1 >= stop_after
        if (step + 1) % t.save_every == 0 or step + 1 == t.steps or stopping:
            save_checkpoint(out, step + 1, drafter, optimizer, scheduler, t.keep_checkpoints)
        if stopping:
            break
    bar.close()

    drafter.eval()
    save_drafter(drafter, out / "drafter")
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    plot_losses(records, out / "loss.png")
    done = records[-1]["step"] if records else 0
    return {"drafter_dir": str(out / "drafter"), "steps_done": done, "steps": t.steps, "log": str(log_path),
            "final": records[-1] if records else {}}


def plot_losses(records: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("loss", "ce", "tv", "conf", "soft_ce", "heldout_loss", "accept_len", "heldout_accept_len")
            if any(k in r for r in records)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k in keys:
        pts = [(r["step"], r[k]) for r in records if k in r]
        held = k.startswith("heldout")
        axes[1 if k.endswith("accept_len") else 0].plot(*zip(*pts), label=k, linewidth=2 if held else 1,
                                                        marker="o" if held else None, markersize=3)
    axes[0].set_xlabel("step"), axes[0].set_title("training losses"), axes[0].legend()
    axes[1].set_xlabel("step"), axes[1].set_title("teacher-forced expected accepted length"), axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="training config JSON (dspark/train/configs/)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="cached dataset directory (meta.json + shards)")
    source.add_argument("--regen", help="regenerated shards (dspark.train.regenerate); features computed online")
    parser.add_argument("--feature-cache", help="with --regen: keep the computed features here (about 7 KB a token)")
    parser.add_argument("--feature-precision", default="fp32", choices=("fp32", "bf16", "int8", "auto"),
                        help="with --regen: the target's matmuls for the features (bf16: ~2x faster on CPUs with "
                             "bf16 dot products)")
    parser.add_argument("--held-out-share", type=float, default=HELD_OUT_SHARE, help="with --regen: records held out")
    parser.add_argument("--max-seq-len", type=int, default=2048, help="with --regen: longer records are cut")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--no-resume", action="store_true", help="start over even if checkpoints exist")
    parser.add_argument("--init", help="a saved drafter directory to start from (a fresh run only)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    parser.add_argument("--bf16", action="store_true", help="train.bf16: bf16 autocast for the drafter (AMX)")
    add_device_flag(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = device_or_exit(args.device, "trainer")
    target = dataset = heldout = None
    if args.regen:
        from dspark.models.config import spread_layers
        from dspark.models.loader import load_model

        name = load_train_config(args.config).get("target") or "smollm2-135m"
        target = load_model(name).model  # fp32 by default: the features every serving precision approximates
        target.set_precision(args.feature_precision)
        layers = spread_layers(target.config.num_layers, 5)
        train_part, held_part = load_split(args.regen, args.held_out_share, args.max_seq_len)
        dataset, heldout = (OnlineDataset(target, [(s.tokens, s.loss_mask) for s in part], layers, name,
                                          args.feature_cache) for part in (train_part, held_part))
        print(f"{args.regen}: {len(train_part)} training and {len(held_part)} held-out sequences, "
              f"{sum(int(s.loss_mask.sum()) for s in train_part)} supervised tokens")
    config = args.config
    if args.bf16:
        config = json.loads(Path(args.config).read_text())
        config.setdefault("train", {})["bf16"] = True
    summary = train(config, args.data, args.out, resume=not args.no_resume, device=device,
                    target=target, dataset=dataset, heldout=heldout, init=args.init)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
