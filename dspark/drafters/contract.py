"""What the speculative loop needs from a drafter, local (dspark.drafters.*) or remote
(verifier_svc.remote_drafter.RemoteDrafter). SpecEngine is typed against this, nothing more.

Per request the drafter keeps a context: the target features of decided positions 0..n-1.
The loop keeps it current (extend_context, rollback to what it knows was kept; after every step
push, which sends a remote drafter its new positions at once) and asks for a block after each
request's anchor. A remote drafter may lose a context (restart): context_len then says what it
still has and the loop resends from there. Failures to reach a remote drafter raise
dspark.speculative.errors.DrafterUnavailable; the step then verifies no drafts.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from dspark.drafters.base import DraftBlock


@runtime_checkable
class DrafterContract(Protocol):
    @property
    def gamma(self) -> int: ...  # block size: draft tokens per request per call

    @property
    def ctx_layers(self) -> list[int]: ...  # target layers whose hidden states make a context feature

    @property
    def kind(self) -> str: ...  # dspark | dflash | eagle3

    @property
    def version(self) -> str: ...  # the checkpoint's identity (calibration is per version)

    @property
    def remote(self) -> bool: ...  # its contexts live in another process: push() sends them there

    @property
    def drafts_ahead(self) -> bool: ...  # it can draft from an anchor past its context (block drafters)

    def context_len(self, req_id: str) -> int: ...

    def extend_context(self, req_id: str, features: torch.Tensor, tokens: torch.Tensor) -> None: ...

    def rollback(self, req_id: str, n_ctx: int) -> None: ...

    def release(self, req_id: str) -> None: ...

    def push(self) -> None: ...  # after each step: a remote drafter sends new positions now (local: nothing)

    # Drafts wanted for their confidences only, answered in the background: True if taken (a
    # remote drafter; at most one in flight), False if the caller must draft instead (local).
    def probe(self, req_ids: list[str], anchors: torch.Tensor, temperatures: torch.Tensor) -> bool: ...

    # (req_ids, conf_logits [R, gamma], tokens [R, gamma]) of an answered probe, once
    def probe_result(self) -> tuple[list[str], torch.Tensor, torch.Tensor] | None: ...

    def draft(self, req_ids: list[str], anchors: torch.Tensor, temperatures: torch.Tensor,
              generators: list) -> DraftBlock: ...

    # Draft-ahead: called while the target verifies the block just drafted; drafts the next block of
    # each request as if its anchor were anchors[i], gaps[i] positions past its context (the block
    # accepted as verified, the drafter's next token the target's own). Does not wait; draft() uses a
    # row when the request's anchor turns out to be that one, at that position. Done beside the
    # target's pass by RemoteDrafter and DraftAheadThread; a bare local drafter does nothing.
    def draft_ahead(self, req_ids: list[str], anchors: list[int], gaps: list[int],
                    temperatures: list[float]) -> None: ...

    # Drafts that cost nothing to make (prompt lookup), from each request's tokens alone (the last
    # is its anchor; no context update needed), while the drafter is skipped: a block over all
    # req_ids (NO_GUESS rows where there is none) on `device`, or None when there is none.
    def free_draft(self, req_ids: list[str], texts: list[list[int]], device=None) -> DraftBlock | None: ...
