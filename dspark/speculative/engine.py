"""Speculative decoding with continuous batching in one process.

Per step, for the running batch:
  1. the drafter (a `dspark.drafters.contract.DrafterContract`) proposes gamma tokens per request,
  2. a policy picks how many of them each request verifies (l_r),
  3. one varlen target pass over [anchor, d_1..d_l] per request (plus prompts of new requests),
  4. chain rejection sampling keeps the output distribution exactly the target's,
  5. the KV cache rolls back to the accepted prefix; the drafter receives the target features
     of the newly decided positions before its next draft.
A request that just arrived is prefilled in the same pass and sampled like plain decoding (a
verification with zero drafts). If the drafter fails, the step verifies no drafts. A policy
may skip drafting for a step (`should_draft`), which then is plain decoding.

A request's draft_len (EngineRequest.draft_len) caps what it verifies per step; the policy
(dspark/speculative/policy.py) spends the step's verify budget within those caps.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dspark.device import host_values
from dspark.drafters.base import DraftBlock, merge_rows
from dspark.drafters.contract import DrafterContract
from dspark.drafters.lookup import NO_GUESS
from dspark.engine.generate import Engine
from dspark.engine.sampler import row_probs, sample_rows
from dspark.engine.sequence import Sequence
from dspark.sampling import SamplingParams
from dspark.speculative.errors import DrafterUnavailable
from dspark.speculative.metrics import SpecMetrics
from dspark.speculative.policy import FixedDraftLen, SpeculationPolicy
from dspark.speculative.probe_check import ProbeChecks
from dspark.speculative.rejection import draw_uniforms, greedy_verify, rejection_sample_auto

# A probe drafts for this many requests at most, in turn. At 16 requests a probe of every row first took
# in all the positions skipped since the last one (689-2,696 rows, 11 us a row) and drafted 16 rows: a
# 35-75 ms step against 16.5, ~3% of the time where drafting never paid (docs/results.md, session 40).
# The budget wants the confidences' level, not every row's: a sample gives it.
PROBE_SAMPLE = 4


@dataclass
class EngineRequest:
    """A request as the serving layer hands it to the engine thread."""
    prompt: list[int]
    params: SamplingParams
    req_id: str
    draft_len: int | None = None  # most draft tokens it verifies per step (None: the block; 0: none)


@dataclass
class SpecState:
    """One request's speculative state: its draft_len, the target features of its decided
    positions (kept for the drafter, in a buffer that grows by doubling: O(new rows) per step),
    how many of them the drafter has, and its acceptance metrics."""
    draft_len: int | None = None
    drafter_synced: int = 0
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    _features: torch.Tensor | None = None
    _logged: int = 0

    def log_features(self, rows: torch.Tensor) -> None:
        n, new = self._logged, rows.shape[0]
        if self._features is None or n + new > self._features.shape[0]:
            grown = rows.new_empty((max(64, 2 * (n + new)), *rows.shape[1:]))
            if self._features is not None:
                grown[:n] = self._features[:n]
            self._features = grown
        self._features[n:n + new] = rows
        self._logged = n + new

    def features(self, start: int, stop: int) -> torch.Tensor:
        return self._features[start:min(stop, self._logged)]


@dataclass
class VerifyStep:
    """One step's pass as built: sequences (new ones first), what each feeds, logits rows."""
    seqs: list[Sequence]
    num_admitted: int  # the first this many are prefills (no drafts)
    heads: list[list[int]]  # prompt (new) or anchor (running) per sequence
    lens: list[int]  # drafts verified per sequence
    pieces: list[list[int]]  # head + drafts: the tokens fed
    logit_rows: list[int]  # flat rows where a decision is made
    batch: object = None
    out: object = None  # the model's output, once verified


@dataclass
class StepReport:
    """What one step did: for load reports, SPS profiling and online calibration."""
    batch_size: int = 0
    batch_tokens: int = 0  # tokens the pass fed: prompts, anchors and every draft verified (lookup's too)
    prefill: bool = False  # the pass held a prompt: its time is no decode step's
    seconds: float = 0.0
    draft_seconds: float = 0.0
    drafted: bool = False  # whether the drafter ran this step (draft_seconds is its cost then)
    draft_context_rows: int = 0  # context positions the drafter took in first (catch-up after skipped steps)
    # The drafter resumed: it did not draft the step before, or first took in more than a block and its
    # bonus token a request. Such a draft costs more than drafting that goes on (positions to catch up,
    # weights out of the caches): no sample of what a drafted step costs.
    draft_resumed: bool = False
    sample_of: int = 0  # the drafter's rows stand for this many (a probe's sample); 0: for themselves
    prefix_reused: int = 0  # prompt tokens this step's new requests took from freed KV slots (prefix reuse)
    # Requests that had a draft block this step, verified or not (verified may be 0): the
    # budget rule needs the confidences of the whole batch, calibration only the verified.
    req_ids: list[str] = field(default_factory=list)
    conf_logits: torch.Tensor | None = None  # [R, gamma] raw confidences of those drafts
    verified: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    # Earlier greedy drafts that were not verified, checked against the tokens the target has
    # decided since (probe_check.py): outcomes for calibration, not part of this step's batch.
    checked_conf: torch.Tensor | None = None  # [M, gamma]
    checked_verified: list[int] = field(default_factory=list)
    checked_accepted: list[int] = field(default_factory=list)


class SpecEngine(Engine):
    def __init__(self, model, drafter: DrafterContract | None = None, policy: SpeculationPolicy | None = None,
                 context_push_every: int = 1, draft_ahead: bool = True, reuse_prefixes: bool = True, **kw):
        """context_push_every: while no draft is asked for, a remote drafter gets its new context every
        N-th step only (0: never; the rest goes with the next probe or draft). draft_ahead: a drafter
        that drafts ahead (drafts_ahead) drafts the next block while the target verifies this one."""
        self.drafter = drafter
        self.draft_ahead = draft_ahead
        self.context_push_every, self._steps_unpushed = max(0, context_push_every), 0
        self.policy = policy or FixedDraftLen(drafter.gamma if drafter is not None else 0)
        super().__init__(model, capture_layers=tuple(drafter.ctx_layers) if drafter is not None else (),
                         reuse_prefixes=reuse_prefixes, **kw)
        # A freed slot's target features, kept with the keys/values it holds: a sequence that reuses
        # its prefix gives the drafter those positions' features as if its own pass had made them.
        self._held_features: dict[int, torch.Tensor] = {}
        self.last_report = StepReport()
        self._checks = ProbeChecks()
        self._probe_starts: dict[str, int] = {}  # greedy requests of the probe in flight: first guessed index
        self._draft_context_rows = 0
        self._drafter_ran = False  # the drafter drafted the last step (draft_resumed)
        self._free = False  # this step's block is a free one (_free_draft)
        self._probe_turn = 0  # where the next probe's sample starts in the running batch
        self._probe_sample_of = 0  # what the background probe's rows stand for
        self._sampled, self._sample_of = False, 0  # this step drafted a sample; what its drafter rows stand for

    def add(self, prompt, params=None, req_id=None, draft_len: int | None = None) -> Sequence:
        seq = super().add(prompt, params, req_id)
        seq.spec = SpecState(draft_len)
        return seq

    def submit(self, request: EngineRequest) -> Sequence:
        return self.add(request.prompt, request.params, request.req_id, request.draft_len)

    def _release(self, seq: Sequence) -> None:
        if self.capture_layers and self.scheduler.reuse_prefixes and seq.slot is not None and seq.cached:
            self._held_features[seq.slot] = seq.spec.features(0, seq.cached)
        super()._release(seq)
        seq.spec._features = None  # the metrics stay for the caller
        if self.drafter is not None:
            try:
                self.drafter.release(seq.req_id)
            except DrafterUnavailable:
                pass  # the drafter frees it when it notices the request is gone

    def _take_held(self, admitted: list[Sequence]) -> None:
        """Admitted sequences that start with a prefix a freed slot held get that slot's features of it
        logged first (the drafter needs every position's); without them the prefix is computed after all."""
        for seq in admitted:
            held = self._held_features.get(seq.prefix_source)
            self._held_features.pop(seq.slot, None)  # the slot's old features: its keys/values are written over
            if not seq.cached or not self.capture_layers:
                continue
            if held is None or held.shape[0] < seq.cached:
                seq.cached = 0
                self.cache.rollback(seq.slot, 0)
            else:
                seq.spec.log_features(held[:seq.cached])

    # ---- drafting ---------------------------------------------------------------------------
    def _sync_drafter(self, seq: Sequence) -> int:
        """Send the drafter the target features of decided positions it has not seen; returns how many."""
        spec = seq.spec
        have = self.drafter.context_len(seq.req_id)
        if have != spec.drafter_synced:  # it lost or kept extra state: resend from what it has
            spec.drafter_synced = min(have, spec.drafter_synced)
            self.drafter.rollback(seq.req_id, spec.drafter_synced)
        if spec.drafter_synced < seq.cached:
            feats = spec.features(spec.drafter_synced, seq.cached)
            toks = host_values(seq.tokens[spec.drafter_synced:seq.cached], torch.long, self.model.device)
            # As logged (bf16): each drafter widens them itself, a remote one sends them as they are.
            self.drafter.extend_context(seq.req_id, feats, toks)
            sent, spec.drafter_synced = seq.cached - spec.drafter_synced, seq.cached
            return sent
        return 0

    def _push_context(self, drafted: bool) -> None:
        """Every running request's new decided positions go to a remote drafter now, drafting or not:
        it extends its contexts while the next target pass runs (RemoteDrafter.push). A local
        drafter would only do the same work sooner on this thread: it is extended when it drafts.
        While no draft is asked for, only every context_push_every-th step pushes (0: none)."""
        if self.drafter is None or not self.drafter.remote:
            return
        self._steps_unpushed = 0 if drafted else self._steps_unpushed + 1
        if self._steps_unpushed and (not self.context_push_every or self._steps_unpushed % self.context_push_every):
            return
        try:
            for seq in self.running:
                self._sync_drafter(seq)
            self.drafter.push()
        except DrafterUnavailable:
            pass  # the next draft finds out what it holds and resends

    def _draft(self, seqs: list[Sequence]):
        if self.drafter is None or not seqs:
            return None, [0] * len(seqs)
        caps = [self._draft_len(s) for s in seqs]
        if max(caps) == 0:
            return None, caps
        # A seeded sampled request must replay exactly, so its verification length may not
        # depend on other requests or on the scheduler's state: it verifies a fixed number.
        seeded = [s.params.seed is not None and s.params.temperature > 0 for s in seqs]
        fixed = self.policy.default_draft_len
        if not self.policy.should_draft(len(seqs)) and not (fixed and any(seeded)):
            block = self._free_draft(seqs) if self.policy.free_may_pay(len(seqs)) else None
            if block is None:
                return None, [0] * len(seqs)
            lens = self.policy.free_lengths(block, caps)
            return block, [0 if seeded[i] else n for i, n in enumerate(lens)]  # a seeded replay verifies none
        rows = self._probe_sample(len(seqs)) if self.policy.probing and not any(seeded) else list(range(len(seqs)))
        drafted = [seqs[i] for i in rows]
        device = self.model.device
        req_ids = [s.req_id for s in drafted]
        anchors = host_values([s.tokens[-1] for s in drafted], torch.long, device)
        temperatures = host_values([s.params.temperature for s in drafted], torch.float32, device)
        try:
            # Positions the drafter takes in before it drafts: one per request when it is current.
            self._draft_context_rows = sum(self._sync_drafter(s) for s in drafted)
            if self.policy.probing and not any(seeded) and self.drafter.probe(req_ids, anchors, temperatures):
                self._probe_starts = {s.req_id: len(s.tokens) for s in drafted if s.params.temperature == 0}
                self._probe_sample_of = len(seqs) if len(rows) < len(seqs) else 0  # every row is the drafter's
                return None, [0] * len(seqs)  # answered in the background: this step decodes plainly
            block = self.drafter.draft(req_ids, anchors, temperatures, [s.generator for s in drafted])
            if self.policy.probing and block.calibrated is not None and bool(block.calibrated.all()):
                self.policy.probe_missed()  # lookup guessed for every request: no confidences of the drafter's
        except DrafterUnavailable:
            return None, [0] * len(seqs)
        if len(rows) < len(seqs):
            block, caps = self._widen_sample(block, rows, len(seqs)), [caps[i] if i in rows else 0 for i in
                                                                         range(len(seqs))]
        lens = list(self.policy.lengths(block, caps, self._sample_of))
        for i in range(len(seqs)):
            if seeded[i]:
                lens[i] = min(caps[i], fixed)
        return block, lens

    def _probe_sample(self, num: int) -> list[int]:
        """The rows a probe drafts for: all of a small batch, else PROBE_SAMPLE of them in turn. Chosen by
        position in the batch only, never by a draft, so the choice cannot bias the output."""
        if num <= PROBE_SAMPLE:
            return list(range(num))
        first = self._probe_turn % num
        self._probe_turn = first + PROBE_SAMPLE
        return sorted((first + j) % num for j in range(PROBE_SAMPLE))

    def _widen_sample(self, block: DraftBlock, rows: list[int], num: int) -> DraftBlock:
        """A sample's block as one of the whole batch: the other rows without drafts, marked as not the
        drafter's (out of the report and the checks, as lookup's are). The drafter's rows of the sample
        stand for as many of the batch's as their share of the sample says."""
        calibrated = block.calibrated if block.calibrated is not None else torch.zeros(len(rows), dtype=torch.bool)
        own = len(rows) - int(calibrated.sum())
        self._sampled, self._sample_of = True, round(own * num / len(rows)) if own else 0
        others = [i for i in range(num) if i not in rows]
        gamma, device = block.tokens.shape[1], block.tokens.device
        empty = DraftBlock(torch.zeros(len(others), gamma, dtype=torch.long, device=device),
                           None if block.conf_logits is None else
                           torch.full((len(others), gamma), NO_GUESS, device=device),
                           torch.zeros(len(others), gamma, 1, dtype=torch.long, device=device),
                           torch.ones(len(others), gamma, 1, device=device),
                           calibrated=torch.ones(len(others), dtype=torch.bool, device=device))
        return merge_rows(num, [(rows, block), (others, empty)])

    def _draft_ahead(self, seqs: list[Sequence], block_tokens: list[list[int]], lens: list[int]) -> None:
        """While the target verifies this block, the drafter drafts each request's next one, guessing
        that all l verified drafts are accepted and that the target's next token is the drafter's
        draft l+1: the only next anchor knowable before the pass (after a rejection the target picks
        the token). The guess holds as often as l+1 drafts would be accepted; draft() then takes
        that row without a round trip on the critical path. A seeded sampled request drafts afresh:
        its replay may not depend on which drafts were made ahead."""
        if not (self.draft_ahead and self.drafter.drafts_ahead):
            return
        gamma, rows = self.drafter.gamma, []
        for i, seq in enumerate(seqs):
            n = lens[i]
            if (n < gamma and not (seq.params.seed is not None and seq.params.temperature > 0)
                    and len(seq.output) + n + 2 < seq.params.max_tokens and seq.cached + n + 2 < self.max_len):
                rows.append(i)
        if not rows:
            return
        try:
            self.drafter.draft_ahead([seqs[i].req_id for i in rows], [block_tokens[i][lens[i]] for i in rows],
                                     [lens[i] + 1 for i in rows], [seqs[i].params.temperature for i in rows])
        except DrafterUnavailable:
            pass  # the next draft finds out

    def _free_draft(self, seqs: list[Sequence]):
        """While the drafter is skipped, the drafts that cost nothing (prompt lookup), verified as far
        as the policy's free_lengths says they pay. Kept out of the step report and the checks: the
        budget and the calibration are the drafter's, and lookup scores its own guesses. None when
        there are none."""
        started = time.perf_counter()
        block = self.drafter.free_draft([s.req_id for s in seqs], [s.tokens for s in seqs], self.model.device)
        self.policy.observe_lookup(time.perf_counter() - started, len(seqs))
        self._free = block is not None
        return block

    def _take_probe(self, report: StepReport) -> None:
        """A background probe's confidences, once answered, go to the policy and, as drafts none of
        which was verified, into this step's report (the scheduler's budget comes from them)."""
        if self.drafter is None or not self.drafter.remote:
            return
        answer = self.drafter.probe_result()
        if answer is None or report.req_ids:  # a step that drafted has newer confidences of its own
            return
        req_ids, conf_logits, tokens = answer
        starts, self._probe_starts = self._probe_starts, {}
        for i, req_id in enumerate(req_ids):
            if req_id in starts:  # greedy: the target decides what the probe guessed
                self._checks.add(req_id, starts[req_id], tokens[i].tolist(), conf_logits[i])
        self.policy.observe_probe(conf_logits, self._probe_sample_of)
        report.req_ids, report.conf_logits = list(req_ids), conf_logits
        report.sample_of = self._probe_sample_of
        report.verified, report.accepted = [0] * len(req_ids), [0] * len(req_ids)

    def _take_checks(self, step: VerifyStep, report: StepReport) -> None:
        """Outcomes of this step's verified drafts and of earlier unverified greedy ones that the
        target has now decided: to the policy's live offset and into the report."""
        if report.req_ids and report.conf_logits is not None and any(report.verified):
            self.policy.observe_outcomes(report.conf_logits, report.accepted, report.verified)
        if not self._checks:
            return
        settled = self._checks.collect({s.req_id: s for s in step.seqs})
        if settled is not None:
            report.checked_conf, report.checked_accepted, report.checked_verified = settled
            self.policy.observe_outcomes(*settled)

    def _draft_len(self, seq: Sequence) -> int:
        """Most drafts this request may verify this step: its draft_len, the block size, room left."""
        room = min(self.max_len - seq.cached - 1, seq.params.max_tokens - len(seq.output) - 1)
        draft_len = seq.spec.draft_len
        cap = self.drafter.gamma if draft_len is None else min(draft_len, self.drafter.gamma)
        return max(0, min(cap, room))

    # ---- one step: build, verify, commit -------------------------------------------------
    def step(self) -> list[tuple[Sequence, list[int]]]:
        t0 = time.perf_counter()
        decoding = list(self.running)  # requests already past their prefill
        admitted = self.scheduler.admit()
        self._take_held(admitted)
        prefix_reused = sum(seq.cached for seq in admitted)
        self._draft_context_rows, self._free, self._sampled, self._sample_of = 0, False, False, 0
        block, lens = self._draft(decoding)
        # One copy to the host, which also waits for a GPU drafter: its time is counted as drafting.
        block_tokens = block.tokens.tolist() if block is not None else []
        draft_seconds = time.perf_counter() - t0
        if not admitted and not decoding:
            return []
        if block is not None and not self._free and not self._sampled:
            self._draft_ahead(decoding, block_tokens, lens)
        step = self._build(admitted, decoding, block_tokens, lens)
        num_acc, out_tokens = self._verify(step, block)
        events = self._commit(step, num_acc, out_tokens, None if self._free else block)
        self._take_probe(self.last_report)
        self._take_checks(step, self.last_report)
        # A free block (lookup while skipped) is not drafting: no draft cost, nothing for the drafter's tables.
        drafted = block is not None and not self._free
        self._push_context(drafted=drafted)
        self.last_report.draft_seconds, self.last_report.drafted = draft_seconds, drafted
        self.last_report.draft_context_rows = self._draft_context_rows
        intake = len(step.seqs) * (1 + self.drafter.gamma) if self.drafter is not None else 0
        self.last_report.draft_resumed = drafted and (not self._drafter_ran or self._draft_context_rows > intake)
        self._drafter_ran = drafted
        if self._sample_of:
            self.last_report.sample_of = self._sample_of
        self.last_report.prefix_reused = prefix_reused
        self.last_report.seconds = time.perf_counter() - t0
        if self._free and not step.num_admitted:  # a decode step that verified free blocks: what it gave
            self.policy.observe_free_step(len(step.seqs), sum(len(new) for _, new in events), self.last_report.seconds)
        return events

    def _build(self, admitted: list[Sequence], decoding: list[Sequence], block_tokens, lens) -> VerifyStep:
        """What this pass feeds: prompts of new requests (zero drafts), anchor + drafts of the others."""
        seqs = admitted + decoding
        lens = [0] * len(admitted) + list(lens)
        drafts = [[] for _ in admitted] + [block_tokens[i][:n] if n else [] for i, n in enumerate(lens[len(admitted):])]
        heads = [s.pending() for s in seqs]  # prompt for new requests, the anchor for the others
        # Logits where a decision is made: each draft position and the bonus position.
        rows, first = [], 0
        for h, n in zip(heads, lens):
            rows.extend(range(first + len(h) - 1, first + len(h) + n))
            first += len(h) + n
        return VerifyStep(seqs, len(admitted), heads, lens, [h + d for h, d in zip(heads, drafts)], rows)

    def _verify(self, step: VerifyStep, block) -> tuple[list[int], list[list[int]]]:
        """One target pass, then chain rejection sampling: accepted drafts and the next token per request."""
        greedy = all(s.params.temperature <= 0 for s in step.seqs)  # every row one-hot: the argmax decides
        step.batch, step.out = self.runner.run(step.seqs, step.pieces, step.logit_rows, greedy=greedy)
        device, lens = self.runner.device, step.lens
        if greedy:  # the drafts matched against the argmax (none verified: the argmax is the token)
            drafts = [piece[len(head):] for piece, head in zip(step.pieces, step.heads)]
            return greedy_verify(step.out.tokens.tolist(), drafts)
        if not sum(lens):  # plain decoding this step: the plain engine's sampler draws the same tokens
            # with the same uniforms (one per request, inverse CDF of p), minus the verification's tensors
            return [0] * len(step.seqs), [[t] for t in sample_rows(step.out.logits, step.seqs)]
        probs = row_probs(step.out.logits, step.seqs, [n + 1 for n in lens])
        # Drafts verified means a block: a remote drafter's arrives on the host (the wire), a local one's is here.
        spec_rows = [(i, j) for i, n in enumerate(lens[step.num_admitted:]) for j in range(n)]
        idx_r = host_values([r for r, _ in spec_rows], torch.long, block.tokens.device)
        idx_j = host_values([j for _, j in spec_rows], torch.long, block.tokens.device)
        draft_tokens = block.tokens[idx_r, idx_j].to(device, non_blocking=True)
        support_ids = block.support_ids[idx_r, idx_j].to(device, non_blocking=True)
        support_probs = block.support_probs[idx_r, idx_j].to(device, non_blocking=True)
        u_acc, u_res = draw_uniforms(lens, [s.generator for s in step.seqs], device)
        num_acc, out_tokens = rejection_sample_auto(probs, draft_tokens, support_ids, support_probs,
                                                    host_values(lens, torch.long, device), u_acc, u_res)
        return num_acc.tolist(), out_tokens.tolist()  # tokens out: one copy to the host

    def _commit(self, step: VerifyStep, num_acc: list[int], out_tokens: list[list[int]], block):
        """Accepted tokens become context: cache rolled back past the rejected drafts, features kept
        for the drafter, metrics and the step report updated, finished requests released."""
        report = StepReport(batch_size=len(step.seqs), batch_tokens=len(step.batch.tokens),
                            prefill=step.num_admitted > 0)
        events, first = [], 0
        features = step.out.features.to(torch.bfloat16) if self.capture_layers else None  # one conversion a step
        # The report and the checks are the drafter's: its budget and calibration. Rows that prompt
        # lookup filled score themselves (LookupStats); in the report their confidences would pass
        # for the drafter's and keep a drafter that does not pay verified.
        lookup_rows = set() if block is None or block.calibrated is None else \
            set(torch.nonzero(block.calibrated).flatten().tolist())
        report_rows = []
        for i, seq in enumerate(step.seqs):
            n_acc, n_head = num_acc[i], len(step.heads[i])
            kept = n_head + n_acc  # rows of this pass that are now decided context
            if self.capture_layers:
                seq.spec.log_features(features[first:first + kept])
            first += n_head + step.lens[i]
            row = i - step.num_admitted
            if (block is not None and row >= 0 and row not in lookup_rows and step.lens[i] == 0
                    and block.conf_logits is not None and seq.params.temperature == 0):
                # drafted, none verified: checked once decided
                self._checks.add(seq.req_id, len(seq.tokens), block.tokens[row].tolist(), block.conf_logits[row])
            seq.cached += kept
            self.cache.rollback(seq.slot, seq.cached)
            new = []
            for tok in out_tokens[i][: n_acc + 1]:
                seq.append(tok, self.eos_ids)
                new.append(tok)
                if seq.done:
                    break
            if i >= step.num_admitted:
                seq.spec.metrics.record(step.lens[i], n_acc, len(new))
                if block is not None and row not in lookup_rows:
                    report_rows.append(row)
                    report.req_ids.append(seq.req_id)
                    report.verified.append(step.lens[i])
                    report.accepted.append(n_acc)
            events.append((seq, new))
            if seq.done:
                self._release(seq)
        if block is not None and block.conf_logits is not None and report.req_ids:
            report.conf_logits = block.conf_logits if not lookup_rows else block.conf_logits[report_rows]
        self.last_report = report
        return events
