"""RemoteDrafter: the Drafter interface SpecEngine expects, over one long-lived DraftStream.

extend_context / rollback / release only buffer per-request updates; push() sends the new
positions without waiting (a context-only request, after every step, drafting or not), and
draft() sends what is left in one DraftRequest with the anchors and waits (up to a deadline)
for the blocks; probe() sends a DraftRequest whose answer (only its confidences count) is taken
by probe_result() at a later step, so the target never waits for it. draft_ahead() sends the
next step's drafts while the target verifies, on a guess; draft() takes the rows whose guess
held and asks afresh only for the others. Any failure
raises DrafterUnavailable, so that step runs as plain decoding, and a background thread
reconnects; context_len then reports 0 so SpecEngine resends whole contexts. All calls but
close() come from the one engine thread.
"""
from __future__ import annotations

import ipaddress
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field

import grpc
import torch

from dspark.drafters.ahead import Guesses
from dspark.drafters.base import DraftBlock, merge_rows
from dspark.models.threads import SMALL_HOST_CORES
from dspark.proto_gen.v1 import drafter_pb2, drafter_pb2_grpc
from dspark.serving import metrics
from dspark.serving.config import sync_channel
from dspark.speculative.errors import DrafterUnavailable
from dspark.wire import WireError, tensor_from_proto, tensor_to_proto

log = logging.getLogger(__name__)



def ahead_pays(address: str, cores: int) -> bool:
    """Whether to draft ahead by default. A draft ahead runs beside the target's pass: free when the
    drafter has hardware of its own (another host or pod, a GPU), but on a machine of a few cores
    that both share it takes the pass's cores and memory bandwidth, and most guesses miss with a
    weak drafter (2-core host: 0.91x with it, docs/results.md)."""
    host = address.rsplit(":", 1)[0].strip("[]") if not address.startswith("unix:") else "localhost"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
        except (OSError, ValueError, IndexError):  # not resolvable from here: not this machine
            return True
    return not (ip.is_loopback and cores < SMALL_HOST_CORES)


@dataclass
class _Ahead:
    """A draft-ahead request in flight: its step, its guesses, the answer once read off the stream."""
    step: int
    guesses: Guesses
    answer: drafter_pb2.DraftResponse | None = None


@dataclass
class _Pending:
    """Updates for one request not sent yet: truncate to `base`, then append these rows."""
    base: int
    features: list = field(default_factory=list)  # [n_i, m*d] chunks
    tokens: list = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.base + len(self.tokens)


class _Link:
    """One DraftStream call: requests go in through a queue, a reader thread collects responses."""

    def __init__(self, channel: grpc.Channel):
        self.channel = channel
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.responses: queue.SimpleQueue = queue.SimpleQueue()
        self.alive = True
        self.call = drafter_pb2_grpc.DrafterStub(channel).DraftStream(iter(self.requests.get, None))
        threading.Thread(target=self._read, daemon=True, name="drafter-link").start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self.responses.put(response)
            error = DrafterUnavailable("drafter closed the stream")
        except grpc.RpcError as e:
            error = DrafterUnavailable(f"drafter stream failed: {e.code().name} {e.details()}")
        self.alive = False
        self.responses.put(error)

    def close(self) -> None:
        self.alive = False
        self.requests.put(None)
        self.call.cancel()
        self.channel.close()


class RemoteDrafter:
    def __init__(self, address: str, timeout_s: float = 2.0, max_message_mb: float = 256,
                 reconnect_s: float = 0.5):
        self.address, self.timeout_s, self.max_message_mb, self.reconnect_s = address, timeout_s, max_message_mb, reconnect_s
        self.info: drafter_pb2.DrafterInfoResponse | None = None
        self._link: _Link | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._known: dict[str, int] = {}  # context length the drafter is known to hold
        self._pending: dict[str, _Pending] = {}
        self._releases: set[str] = set()
        self._sent: set[str] = set()  # requests the drafter on the current link may hold
        self._step = 0
        self.last_bytes = 0  # both directions, last draft() call
        self.trace_context = None  # req_id -> {"traceparent": ...} of its step span (tracing on)
        self._probe: tuple[int, list[str], float] | None = None  # (step, req_ids, sent at) in flight
        self._probe_answer: tuple[list[str], torch.Tensor] | None = None
        self._ahead: _Ahead | None = None

    @property
    def remote(self) -> bool:
        return True

    @property
    def drafts_ahead(self) -> bool:
        return self.info is not None and self.info.drafts_ahead

    # ---- connection ------------------------------------------------------------------------
    def connect(self, wait_s: float) -> bool:
        """Fetch DrafterInfo and open the stream, retrying for up to wait_s; then keep it up."""
        deadline = time.monotonic() + wait_s
        while not self._try_connect():
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.reconnect_s)
        threading.Thread(target=self._maintain, daemon=True, name="drafter-reconnect").start()
        return True

    def _try_connect(self) -> bool:
        channel = sync_channel(self.address, self.max_message_mb)
        try:
            info = drafter_pb2_grpc.DrafterStub(channel).DrafterInfo(drafter_pb2.DrafterInfoRequest(), timeout=2)
        except grpc.RpcError:
            channel.close()
            return False
        if self.info is not None and (info.gamma, list(info.target_layers), info.hidden_size) != (
                self.info.gamma, list(self.info.target_layers), self.info.hidden_size):
            log.error("drafter at %s changed shape (gamma/layers/width); not using it", self.address)
            channel.close()
            return False
        if self.info is not None and info.version != self.info.version:
            log.warning("drafter version changed: %s -> %s", self.info.version, info.version)
        self.info = info
        link = _Link(channel)
        with self._lock:
            old, self._link = self._link, link
        if old is not None:
            old.close()
        log.info("drafter stream open to %s (%s %s)", self.address, info.kind, info.version)
        return True

    def _maintain(self) -> None:
        while not self._closed.wait(self.reconnect_s):
            link = self._link
            if link is None or not link.alive:
                self._try_connect()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            if self._link is not None:
                self._link.close()

    @property
    def connected(self) -> bool:
        return self._link is not None and self._link.alive

    # ---- identity (DrafterInfo) ------------------------------------------------------------
    @property
    def gamma(self) -> int:
        return self.info.gamma

    @property
    def ctx_layers(self) -> list[int]:
        return list(self.info.target_layers)

    @property
    def kind(self) -> str:
        return self.info.kind

    @property
    def version(self) -> str:
        return self.info.version

    @property
    def has_confidence(self) -> bool:
        return self.info.has_confidence

    @property
    def sts_temperatures(self):
        """The checkpoint's shipped STS temperatures (float64 [gamma]), None if it has none."""
        info = self.info
        if not info.HasField("sts_temperatures"):
            return None
        try:
            temps = tensor_from_proto(info.sts_temperatures, torch.float32, (info.gamma,)).double().numpy()
        except WireError as error:
            log.warning("ignoring the drafter's shipped STS temperatures: %s", error)
            return None
        return temps if (temps > 0).all() else None

    # ---- context bookkeeping: buffered, sent with the next draft ---------------------------
    def context_len(self, req_id: str) -> int:
        pending = self._pending.get(req_id)
        return pending.length if pending else self._known.get(req_id, 0)

    def rollback(self, req_id: str, n_ctx: int) -> None:
        pending = self._pending.get(req_id)
        if pending is None:
            self._pending[req_id] = _Pending(base=min(n_ctx, self._known.get(req_id, 0)))
        elif n_ctx >= pending.base:  # drop buffered rows past n_ctx
            keep = n_ctx - pending.base
            rows = torch.cat(pending.features)[:keep] if pending.features else None
            pending.features = [rows] if rows is not None and len(rows) else []
            pending.tokens = pending.tokens[:keep]
        else:
            self._pending[req_id] = _Pending(base=n_ctx)

    def extend_context(self, req_id: str, features: torch.Tensor, tokens: torch.Tensor) -> None:
        pending = self._pending.setdefault(req_id, _Pending(base=self._known.get(req_id, 0)))
        pending.features.append(features.to(torch.bfloat16))  # the engine logs bf16: lossless
        pending.tokens.extend(tokens.tolist())

    def release(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
        self._known.pop(req_id, None)
        if req_id in self._sent:
            self._sent.discard(req_id)
            self._releases.add(req_id)

    def _forget_all(self) -> None:
        """We no longer know what the drafter holds: make SpecEngine resend from 0."""
        self._known.clear()
        self._pending.clear()

    def push(self) -> None:
        """Send every buffered new position now, drafting nothing: the drafter extends its contexts
        while the target runs, so the next draft waits only for the draft. No answer comes back;
        a context the drafter turns out not to hold shows up as context_missing at the next draft.
        Releases and pure rollbacks stay buffered for the next draft request."""
        link = self._link
        if link is None or not link.alive:
            return  # draft() notices, and resets what we know
        request = drafter_pb2.DraftRequest(step=self._step, context_only=True)
        for req_id, pending in list(self._pending.items()):
            if not pending.tokens:
                continue
            update = request.sequences.add(request_id=req_id, context_len=pending.base, tokens=pending.tokens)
            update.hidden.CopyFrom(tensor_to_proto(torch.cat(pending.features)))
            self._known[req_id] = pending.length
            self._sent.add(req_id)
            del self._pending[req_id]
        if request.sequences:
            link.requests.put(request)
            metrics.DRAFTER_LINK_BYTES.labels("to_drafter").inc(request.ByteSize())

    # ---- drafting --------------------------------------------------------------------------
    def _draft_request(self, req_ids, anchors, temperatures, generators,
                       gaps=None) -> tuple[drafter_pb2.DraftRequest, dict]:
        """A DraftRequest with the buffered releases and, per request, its unsent context and anchor;
        also the context length each request will have once the drafter applies it."""
        self._step += 1
        request = drafter_pb2.DraftRequest(step=self._step)
        for req_id in sorted(self._releases):
            request.sequences.add(request_id=req_id, release=True)
        sent_len = {}
        for i, req_id in enumerate(req_ids):
            pending = self._pending.get(req_id) or _Pending(base=self._known.get(req_id, 0))
            update = request.sequences.add(request_id=req_id, anchor_token=int(anchors[i]),
                                           context_len=pending.base, temperature=float(temperatures[i]),
                                           tokens=pending.tokens, ahead=gaps[i] if gaps else 0)
            if pending.features:
                update.hidden.CopyFrom(tensor_to_proto(torch.cat(pending.features)))
            seed = getattr(generators[i], "initial_seed", None) if generators and generators[i] is not None else None
            if seed is not None:
                update.seed = seed()
            if self.trace_context is not None:
                update.trace_context.update(self.trace_context(req_id))
            sent_len[req_id] = pending.length
            self._sent.add(req_id)
        return request, sent_len

    def _live_link(self) -> _Link:
        link = self._link
        if link is None or not link.alive:
            self._lost()
            raise DrafterUnavailable(f"no drafter stream to {self.address}")
        return link

    def free_draft(self, req_ids, texts, device=None) -> DraftBlock | None:
        """None: every draft here costs a round trip."""
        return None

    def draft(self, req_ids, anchors, temperatures, generators, forced_tokens=None, return_logits=False) -> DraftBlock:
        """Rows drafted ahead whose guess held (anchor and position) are taken as they are; the other
        requests are drafted now, in one request sent before waiting on the one ahead."""
        link = self._live_link()
        ahead, self._ahead = self._ahead, None
        anchor_list = [int(a) for a in anchors]
        held, fresh = ([], list(range(len(req_ids)))) if ahead is None else ahead.guesses.split(
            req_ids, [self.context_len(r) for r in req_ids], anchor_list)
        self.last_bytes = 0
        if fresh:
            request, sent_len = self._draft_request([req_ids[i] for i in fresh], [anchor_list[i] for i in fresh],
                                                    [float(temperatures[i]) for i in fresh],
                                                    [generators[i] for i in fresh])
            link.requests.put(request)
            self._releases.clear()
            step = self._step
        ahead_block = None
        if held:  # drafted while the target verified the last block: probably answered already
            response = ahead.answer or self._await(link, ahead.step)
            ids = [req_ids[i] for i in held]
            ahead_block = self._to_block(ids, response, None)
            metrics.DRAFTS_AHEAD_USED.inc(len(ids))
        if not fresh:
            return ahead_block
        response = self._await(link, step)
        self.last_bytes = request.ByteSize() + response.ByteSize()
        metrics.DRAFTER_LINK_BYTES.labels("to_drafter").inc(request.ByteSize())
        metrics.DRAFTER_LINK_BYTES.labels("from_drafter").inc(response.ByteSize())
        metrics.DRAFTER_LINK_BYTES_PER_STEP.observe(self.last_bytes)
        for i in fresh:
            self._pending.pop(req_ids[i], None)
        block = self._to_block([req_ids[i] for i in fresh], response, sent_len)
        return block if ahead_block is None else merge_rows(len(req_ids), [(held, ahead_block), (fresh, block)])

    def draft_ahead(self, req_ids, anchors, gaps, temperatures) -> None:
        """Send, without waiting, each request's next block as if its anchor were anchors[i], gaps[i]
        positions past the context sent with it (the drafter has those positions' tokens but not
        their features yet). Carries the unsent context like a push; one set of guesses at a time."""
        link = self._link
        if not self.drafts_ahead or link is None or not link.alive or not req_ids:
            return
        request, sent_len = self._draft_request(req_ids, anchors, temperatures, None, gaps)
        link.requests.put(request)
        metrics.DRAFTER_LINK_BYTES.labels("to_drafter").inc(request.ByteSize())
        metrics.DRAFTS_AHEAD_SENT.inc(len(req_ids))
        self._releases.clear()
        for req_id in req_ids:  # as after a push: a context it turns out not to hold shows at the next draft
            self._known[req_id] = sent_len[req_id]
            self._pending.pop(req_id, None)
        self._ahead = _Ahead(self._step, Guesses(req_ids, [sent_len[r] + g for r, g in zip(req_ids, gaps)], anchors))

    def _await(self, link: _Link, step: int) -> drafter_pb2.DraftResponse:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                response = link.responses.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                # Slow, not necessarily gone: it may still apply this request, so its state is unknown.
                self._forget_all()
                raise DrafterUnavailable(f"drafter did not answer within {self.timeout_s} s") from None
            if isinstance(response, Exception):
                self._lost()
                raise response
            if response.step == step:
                return response
            self._route(response)  # else a late answer to a step we gave up on: skip it

    def _lost(self) -> None:
        """The stream is gone: a new drafter holds none of our requests and answers no probe."""
        self._forget_all()
        self._releases.clear()
        self._sent.clear()
        self._probe = None
        self._ahead = None

    # ---- probes: drafts wanted for their confidences only -----------------------------------
    def probe(self, req_ids, anchors, temperatures) -> bool:
        """Ask for drafts and do not wait: while the verify budget is 0 only their confidences
        matter (they tell the scheduler when drafting would pay again), so the target keeps
        decoding and probe_result() picks the answer up at a later step. The request carries the
        unsent context like a push. At most one probe is in flight (one older than the draft
        deadline is given up); True whenever it is handled here, sent or not."""
        link = self._link
        if link is None or not link.alive:
            return True  # the next draft notices and resets what we know
        if self._probe is not None and time.monotonic() - self._probe[2] < self.timeout_s:
            return True
        request, sent_len = self._draft_request(req_ids, anchors, temperatures, [None] * len(req_ids))
        link.requests.put(request)
        metrics.DRAFTER_LINK_BYTES.labels("to_drafter").inc(request.ByteSize())
        self._releases.clear()
        for req_id in req_ids:  # as after a push: a context it turns out not to hold shows at the next draft
            self._known[req_id] = sent_len[req_id]
            self._pending.pop(req_id, None)
        self._probe = (self._step, list(req_ids), time.monotonic())
        return True

    def probe_result(self) -> tuple[list[str], torch.Tensor, torch.Tensor] | None:
        """(req_ids, raw confidence logits [R, gamma], draft tokens [R, gamma]) of a probe answered
        since the last call, else None. Never blocks: it takes what the stream has delivered."""
        link = self._link
        while link is not None and self._probe is not None and self._probe_answer is None:
            try:
                response = link.responses.get_nowait()
            except queue.Empty:
                break
            if isinstance(response, Exception):
                self._lost()
                break
            self._route(response)
        answer, self._probe_answer = self._probe_answer, None
        return answer

    def _route(self, response: drafter_pb2.DraftResponse) -> None:
        """An answer read while waiting for another: a probe's, kept for probe_result; a draft-ahead's,
        kept for the next draft(); anything else is late and dropped."""
        if self._ahead is not None and response.step == self._ahead.step:
            self._ahead.answer = response
        else:
            self._maybe_probe_answer(response)

    def _maybe_probe_answer(self, response: drafter_pb2.DraftResponse) -> None:
        if self._probe is None or response.step != self._probe[0]:
            return
        _, req_ids, _ = self._probe
        self._probe = None
        if not self.has_confidence:
            return
        by_id = {s.request_id: s for s in response.sequences}
        rows, conf, tokens = [], [], []
        for req_id in req_ids:
            seq = by_id.get(req_id)
            if seq is None or seq.context_missing:
                continue
            try:
                conf.append(tensor_from_proto(seq.confidence_logits, torch.float32, (self.gamma,)))
            except WireError as error:
                log.warning("ignoring a malformed probe answer: %s", error)
                return
            if len(seq.tokens) != self.gamma:
                log.warning("ignoring a probe answer with %d tokens, expected %d", len(seq.tokens), self.gamma)
                return
            rows.append(req_id)
            tokens.append(list(seq.tokens))
        if rows:
            self._probe_answer = (rows, torch.stack(conf), torch.tensor(tokens, dtype=torch.long))

    def _to_block(self, req_ids, response, sent_len) -> DraftBlock:
        """sent_len: the context each request has once the drafter applied the request (None: a draft
        ahead, whose context bookkeeping was done when it was sent)."""
        by_id = {s.request_id: s for s in response.sequences}
        missing = [r for r in req_ids if r not in by_id or by_id[r].context_missing]
        for req_id in req_ids:
            if req_id in missing:
                self._known[req_id] = 0
                self._pending.pop(req_id, None)
            elif sent_len is not None:
                self._known[req_id] = sent_len[req_id]
        if missing:
            raise DrafterUnavailable(f"drafter lost the context of {len(missing)} request(s); resending")
        gamma = self.gamma
        try:
            rows = [by_id[r] for r in req_ids]
            tokens = torch.tensor([list(s.tokens) for s in rows], dtype=torch.long)
            ids = [tensor_from_proto(s.support_ids, torch.int64, (gamma, None)) for s in rows]
            probs = [tensor_from_proto(s.support_probs, torch.float32, (gamma, ids[i].shape[1]))
                     for i, s in enumerate(rows)]
            conf = None
            if self.has_confidence:
                conf = torch.stack([tensor_from_proto(s.confidence_logits, torch.float32, (gamma,)) for s in rows])
        except (WireError, ValueError) as error:
            self._forget_all()
            raise DrafterUnavailable(f"malformed draft response: {error}") from error
        if tokens.shape != (len(req_ids), gamma):
            self._forget_all()
            raise DrafterUnavailable(f"draft tokens of shape {tuple(tokens.shape)}, expected ({len(req_ids)}, {gamma})")
        width = max(i.shape[1] for i in ids)  # greedy rows have S = 1, sampled ones more: zero-pad
        pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731
        return DraftBlock(tokens=tokens, conf_logits=conf, support_ids=torch.stack([pad(i) for i in ids]),
                          support_probs=torch.stack([pad(p) for p in probs]))
