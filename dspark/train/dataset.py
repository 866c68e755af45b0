"""Training sequences with the target's features: a cached dataset on disk, or computed online.

Cached format (written by the prepare stage; see docs/drafter_format.md): a directory with
meta.json {"target", "ctx_layers", "hidden_size", "num_sequences", "shards": [...]} and
safetensors shards holding, for all their sequences back to back:
  tokens [N] int64, loss_mask [N] uint8 (1 on response tokens), features [N, m*d] bf16 (the
  chosen layers' outputs), final_hidden [N, d] bf16 (final-normed: lm_head of row t gives the
  target distribution of token t+1), offsets [S+1] int64 (sequence boundaries);
  optional target_lse [N] float32 (logsumexp of the target logits of row t; saves computing it).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dspark.models.batch import VarlenBatch
from dspark.models.precision import whole_calls


@dataclass
class Sequence:
    tokens: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] bool
    features: torch.Tensor  # [L, m*d] float32
    final_hidden: torch.Tensor  # [L, d] float32
    target_lse: torch.Tensor | None = None  # [L] float32, when the dataset has it


class CachedDataset:
    """Reads sequences straight from the memory-mapped shards (only the rows asked for)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.meta = json.loads((self.directory / "meta.json").read_text())
        self._files = [safe_open(str(self.directory / name), "pt") for name in self.meta["shards"]]
        self._index = []  # (shard, start, end) per sequence
        for shard, f in enumerate(self._files):
            offsets = f.get_tensor("offsets").tolist()
            self._index += [(shard, s, e) for s, e in zip(offsets[:-1], offsets[1:])]
        if len(self._index) != self.meta["num_sequences"]:
            raise ValueError(f"meta.json says {self.meta['num_sequences']} sequences, shards hold {len(self._index)}")

    @property
    def ctx_layers(self) -> list[int]:
        return list(self.meta["ctx_layers"])

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> Sequence:
        shard, start, end = self._index[i]
        f = self._files[shard]

        def rows(name):
            return f.get_slice(name)[start:end]

        lse = rows("target_lse").float() if "target_lse" in f.keys() else None
        return Sequence(tokens=rows("tokens").long(), loss_mask=rows("loss_mask").bool(),
                        features=rows("features").float(), final_hidden=rows("final_hidden").float(),
                        target_lse=lse)

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token occurs (for choosing the draft vocabulary)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for f in self._files:
            counts += torch.bincount(f.get_tensor("tokens"), minlength=vocab_size)[:vocab_size]
        return counts


@torch.no_grad()
def target_features(model, tokens: torch.Tensor, ctx_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's chosen-layer features [L, m*d] and final-normed hidden [L, d] of one sequence.
    Through a one-slot KV cache where the CPU kernels run: the fused layer path, ~2x the plain one."""
    cache = model.new_cache(1, tokens.shape[0]) if model.cached_kernel else None
    with whole_calls():
        out = model(VarlenBatch.build([tokens.tolist()], [0], [0] if cache is not None else None), cache=cache,
                    capture_layers=list(ctx_layers), logits_rows=None)
    return out.features.float(), out.hidden.float()


@torch.no_grad()
def target_features_and_lse(model, tokens: torch.Tensor, ctx_layers: list[int], chunk: int = 128):
    """target_features plus the full-vocabulary logsumexp of every row's logits [L] (float32), from the
    bf16-rounded hidden state the cache keeps (so it normalises exactly the logits training computes).
    A bf16 target takes the LM-head matmul in bf16 too (fp32 accumulation): 2x faster where the
    CPU has bf16 dot products, and the features are bf16-rounded already."""
    features, hidden = target_features(model, tokens, ctx_layers)
    hidden = hidden.to(torch.bfloat16)
    dtype = torch.bfloat16 if getattr(model, "precision", "fp32") == "bf16" else torch.float32
    weight, rows = _lm_head_in(model, dtype), hidden.to(dtype)
    lse = torch.cat([torch.logsumexp((rows[i:i + chunk] @ weight.T).float(), -1)
                     for i in range(0, hidden.shape[0], chunk)])
    return features, hidden.float(), lse


def _lm_head_in(model, dtype: torch.dtype) -> torch.Tensor:
    """The LM head's weight in `dtype`, converted once per model: converting 113 MB on every
    sequence cost as much as the LM-head matmul itself."""
    cached = getattr(model, "_lm_head_for_lse", None)
    if cached is None or cached.dtype != dtype:
        cached = model.output_weight.detach().to(dtype)
        model._lm_head_for_lse = cached
    return cached


class OnlineDataset:
    """The same Sequence fields computed on the fly from the target.

    cache_dir: keep each sequence's features (bf16, as the cached format stores them) and its
    target logsumexp on disk the first time they are computed, named by a hash of the tokens, the
    layers and the target, so a second pass, a resumed run or the next drafter's run reads them
    instead of running the target again (about 7 KB a token for SmolLM2-135M's five layers).
    """

    def __init__(self, model, sequences: list[tuple[torch.Tensor, torch.Tensor]], ctx_layers: list[int],
                 target_name: str = "", cache_dir: str | Path | None = None):
        self.model, self.sequences, self._ctx_layers = model, sequences, list(ctx_layers)
        self.meta = {"target": target_name, "ctx_layers": self._ctx_layers,
                     "hidden_size": model.config.hidden_size, "num_sequences": len(sequences)}
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)

    def _cache_path(self, tokens: torch.Tensor) -> Path:
        # the target's precision is part of the key: an fp32 and a bf16 target give different features
        precision = getattr(self.model, "precision", "fp32")
        named = [self.meta["target"], self._ctx_layers] + ([] if precision == "fp32" else [precision])
        key = hashlib.sha256(tokens.to(torch.int64).numpy().tobytes() + json.dumps(named).encode()).hexdigest()[:32]
        return self.cache_dir / key[:2] / f"{key}.safetensors"

    @property
    def ctx_layers(self) -> list[int]:
        return self._ctx_layers

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> Sequence:
        tokens, loss_mask = self.sequences[i]
        if self.cache_dir is None:
            features, final_hidden = target_features(self.model, tokens, self._ctx_layers)
            return Sequence(tokens.long(), loss_mask.bool(), features, final_hidden)
        path = self._cache_path(tokens)
        if path.exists():
            stored = load_file(str(path))
        else:
            features, hidden, lse = target_features_and_lse(self.model, tokens, self._ctx_layers)
            stored = {"features": features.to(torch.bfloat16), "final_hidden": hidden.to(torch.bfloat16),
                      "target_lse": lse}
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            save_file(stored, str(tmp))
            tmp.rename(path)  # a cache file is either whole or absent
        return Sequence(tokens.long(), loss_mask.bool(), stored["features"].float(), stored["final_hidden"].float(),
                        stored["target_lse"])

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for tokens, _ in self.sequences:
            counts += torch.bincount(tokens.long(), minlength=vocab_size)[:vocab_size]
        return counts


def write_dataset(directory: str | Path, target_name: str, ctx_layers: list[int], sequences: list[Sequence],
                  shard_tokens: int = 1 << 20) -> Path:
    """Write sequences in the cached format (shards of about `shard_tokens` tokens)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards, pending, pending_tokens = [], [], 0

    def flush():
        name = f"shard_{len(shards):05d}.safetensors"
        lengths = torch.tensor([0] + [s.tokens.shape[0] for s in pending])
        save_file({"tokens": torch.cat([s.tokens.long() for s in pending]),
                   "loss_mask": torch.cat([s.loss_mask.to(torch.uint8) for s in pending]),
                   "features": torch.cat([s.features for s in pending]).to(torch.bfloat16),
                   "final_hidden": torch.cat([s.final_hidden for s in pending]).to(torch.bfloat16),
                   "offsets": lengths.cumsum(0)}, str(directory / name))
        shards.append(name)

    for seq in sequences:
        pending.append(seq)
        pending_tokens += seq.tokens.shape[0]
        if pending_tokens >= shard_tokens:
            flush()
            pending, pending_tokens = [], 0
    if pending:
        flush()
    hidden_size = sequences[0].final_hidden.shape[1]
    meta = {"target": target_name, "ctx_layers": list(ctx_layers), "hidden_size": hidden_size,
            "num_sequences": len(sequences), "shards": shards}
    (directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return directory


@torch.no_grad()
def build_tiny_dataset(model, directory: str | Path, ctx_layers: list[int], num_sequences: int = 8,
                       prompt_len: int = 6, response_len: int = 24, temperature: float = 0.7,
                       seed: int = 0) -> Path:
    """For tests: random prompts, responses sampled from the (tiny) target itself, features cached."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    sequences = []
    for _ in range(num_sequences):
        tokens = torch.randint(0, vocab, (prompt_len,), generator=gen)
        for _ in range(response_len):
            logits = model(VarlenBatch.build([tokens.tolist()], [0]), logits_rows="last").logits[0]
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)
            tokens = torch.cat([tokens, nxt])
        loss_mask = torch.arange(tokens.shape[0]) >= prompt_len
        features, final_hidden = target_features(model, tokens, ctx_layers)
        sequences.append(Sequence(tokens, loss_mask, features, final_hidden))
    return write_dataset(directory, "tiny-random", ctx_layers, sequences)
