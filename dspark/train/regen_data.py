"""Training sequences from the regenerated shards (dspark.train.regenerate): token ids and a loss mask.

A record's sequence is its turns' prompt_ids + response_ids back to back; the loss goes on the
response ids. An answer cut as a loop keeps its first repeats under the loss (the target loops
when serving too, and a drafter that follows a loop gets it accepted) but not the whole window
that proved it a loop: the last LOOP_UNSUPERVISED tokens stay context only.

A fixed share of records, chosen by a hash of the id, is held out: the trainer's held-out loss
and the STS re-fit read only those, and a record never moves between the two sides as the data
grows.
"""
from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

LOOP_UNSUPERVISED = 128
HELD_OUT_SHARE = 0.02


@dataclass(frozen=True)
class RegenSequence:
    id: str
    tokens: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] bool: response tokens the drafter learns


def read_records(directory: str | Path) -> list[dict]:
    """Every record of every shard in the directory, in shard order."""
    records = []
    for shard in sorted(Path(directory).glob("shard_*.jsonl.gz")):
        with gzip.open(shard, "rt") as f:
            records += [json.loads(line) for line in f if line.strip()]
    return records


def to_sequence(record: dict, max_len: int | None = None) -> RegenSequence:
    tokens, mask = [], []
    for turn in record["turns"]:
        response = turn["response_ids"]
        supervised = len(response)
        if turn.get("finish") == "loop":
            supervised = max(0, supervised - LOOP_UNSUPERVISED)
        tokens += turn["prompt_ids"] + response
        mask += [False] * len(turn["prompt_ids"]) + [True] * supervised + [False] * (len(response) - supervised)
    if max_len is not None:
        tokens, mask = tokens[:max_len], mask[:max_len]
    return RegenSequence(record["id"], torch.tensor(tokens, dtype=torch.long), torch.tensor(mask, dtype=torch.bool))


def is_held_out(record_id: str, share: float) -> bool:
    digest = hashlib.sha256(f"heldout:{record_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def load_split(directory: str | Path, held_out_share: float = HELD_OUT_SHARE,
               max_len: int | None = None) -> tuple[list[RegenSequence], list[RegenSequence]]:
    """(training, held-out) sequences with at least one supervised token."""
    train, held = [], []
    for record in read_records(directory):
        seq = to_sequence(record, max_len)
        if seq.loss_mask.any():
            (held if is_held_out(seq.id, held_out_share) else train).append(seq)
    return train, held
