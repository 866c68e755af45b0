"""Greedy drafts that nobody verified, checked against the target afterwards.

While the verify budget is 0 the drafter still probes (its confidences say when drafting would
pay again), but none of its tokens is verified, so calibration got no outcomes exactly when it
needed them: a drafter underrated once stayed skipped. For a greedy request the target then
decodes those positions anyway, and greedy verification accepts draft token k exactly when it
equals the target's token there (tokens 1..k-1 having matched). So once the target has decided
them, the probe's confidences get the very outcomes verification would have given.

Only decided tokens are compared, never a draft that is being verified: the labels change what
later budgets promise, not what any step outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PendingCheck:
    start: int  # index in the request's tokens of the first guessed token
    guess: list[int]  # the draft tokens
    conf: torch.Tensor  # [gamma] their raw confidence logits


def check_outcome(guess: list[int], decided: list[int], finished: bool) -> tuple[int, int] | None:
    """(accepted, verified) as verifying all of `guess` would have reported them, once the target
    has decided every guessed position (or the request ended: the positions it decided). None
    before. `verified` never depends on the guess being right, as a verify length never does."""
    if len(decided) < len(guess) and not finished or not decided:
        return None
    matched = 0
    for g, d in zip(guess, decided):
        if g != d:
            break
        matched += 1
    return matched, min(len(guess), len(decided))


class ProbeChecks:
    """Pending checks by request, settled in the order they were made."""

    def __init__(self):
        self._pending: dict[str, list[PendingCheck]] = {}

    def __len__(self) -> int:
        return sum(map(len, self._pending.values()))

    def add(self, req_id: str, start: int, guess: list[int], conf: torch.Tensor) -> None:
        self._pending.setdefault(req_id, []).append(PendingCheck(start, list(guess), conf.detach().float().cpu()))

    def collect(self, seqs: dict) -> tuple[torch.Tensor, list[int], list[int]] | None:
        """Outcomes settled by now: (conf [M, gamma], accepted [M], verified [M]) or None.
        seqs: req_id -> Sequence for every request the engine still steps or just finished;
        the checks of a request not among them (aborted) are dropped."""
        conf, accepted, verified = [], [], []
        for req_id, checks in list(self._pending.items()):
            seq = seqs.get(req_id)
            waiting = []
            for check in checks if seq is not None else ():
                decided = seq.tokens[check.start:check.start + len(check.guess)]
                outcome = check_outcome(check.guess, decided, seq.done)
                if outcome is None and not seq.done:
                    waiting.append(check)
                elif outcome is not None:
                    conf.append(check.conf)
                    accepted.append(outcome[0])
                    verified.append(outcome[1])
            if waiting:
                self._pending[req_id] = waiting
            else:
                del self._pending[req_id]
        return (torch.stack(conf), accepted, verified) if conf else None
