"""Context push and draft-ahead (issue 13): after every step the verifier sends a remote drafter its
new decided positions without waiting, so the next draft carries no context and waits only for the
draft; while the target verifies a block, the drafter drafts the next one on a guess, and a step
whose guess held waits for no draft at all."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from service_helpers import TOKEN, start_drafter, wait_serving, write_tiny_target
from spec_helpers import random_drafter, tiny_target

from drafter_svc.__main__ import load, parse_args
from drafter_svc.contexts import Limits, answer
from dspark.proto_gen.v1 import drafter_pb2
from dspark.sampling import SamplingParams
from dspark.serving import config
from dspark.wire import WireError, tensor_from_proto, tensor_to_proto
from verifier_svc.remote_drafter import RemoteDrafter


def _update(req, n, ctx, width):
    return drafter_pb2.SequenceUpdate(request_id=req, tokens=list(range(5, 5 + n)), context_len=ctx,
                                      hidden=tensor_to_proto(torch.randn(n, width).bfloat16()))


def test_a_context_push_extends_and_answers_nothing_and_skips_what_it_does_not_hold():
    drafter = random_drafter(tiny_target(), "dspark", gamma=3)
    width = len(drafter.ctx_layers) * drafter.cfg.hidden_size
    keys, limits = OrderedDict(), Limits(drafter.cfg.vocab_size)
    push = drafter_pb2.DraftRequest(step=1, context_only=True, sequences=[_update("a", 4, 0, width),
                                                                           _update("b", 2, 6, width)])
    assert answer(drafter, 1, keys, push, width, limits) is None
    assert drafter.context_len("1:a") == 4 and drafter.context_len("1:b") == 0  # b: not held, skipped
    # The next draft for b says what it lacks; a drafts from the pushed context, with no new rows.
    reply = answer(drafter, 1, keys, drafter_pb2.DraftRequest(step=2, sequences=[
        drafter_pb2.SequenceUpdate(request_id="a", context_len=4, anchor_token=3),
        drafter_pb2.SequenceUpdate(request_id="b", context_len=8, anchor_token=3)]), width, limits)
    assert len(reply.sequences[0].tokens) == 3 and reply.sequences[1].context_missing


class _Recording:
    """The link's request queue, keeping a copy of what goes on it."""

    def __init__(self, queue, sent: list):
        self.queue, self.sent = queue, sent

    def put(self, request) -> None:
        if request is not None:
            self.sent.append(request)
        self.queue.put(request)


@pytest.fixture(scope="module")
def drafter_service(tmp_path_factory):
    torch.set_num_threads(1)
    path = write_tiny_target(tmp_path_factory.mktemp("target"))
    service, address = start_drafter(str(path), tmp_path_factory.mktemp("logs"))
    try:
        wait_serving(address, service, timeout=300)
        yield path, address
    finally:
        service.terminate(30)


@pytest.fixture
def remote(drafter_service, monkeypatch):
    """A verifier's RemoteDrafter connected to the service; `remote.sent` records what it sends."""
    monkeypatch.setenv("DSPARK_INTERNAL_TOKEN", TOKEN)  # the internal plane's credential, as a verifier has it
    config.reset_peer_settings()
    drafter = RemoteDrafter(drafter_service[1], timeout_s=30)
    assert drafter.connect(60)
    drafter.sent = []
    drafter._link.requests = _Recording(drafter._link.requests, drafter.sent)
    try:
        yield drafter
    finally:
        drafter.close()


def _service_weights(path):
    """The drafter the service runs, loaded here as a local one."""
    return load(parse_args([f"--target-model={path}", "--gamma=4", "--num-layers=1"]))[0]


def test_pushed_contexts_draft_what_the_same_context_drafts_locally(drafter_service, remote):
    local, sent = _service_weights(drafter_service[0]), remote.sent
    width = len(local.ctx_layers) * local.cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(12, width, generator=g).bfloat16().float()
    toks = torch.randint(0, local.cfg.vocab_size, (12,), generator=g)
    remote.extend_context("r", feats[:7], toks[:7])
    remote.push()
    remote.rollback("r", 5)  # two rejected positions, then the accepted ones: as a step leaves it
    remote.extend_context("r", feats[5:], toks[5:])
    remote.push()
    assert remote.context_len("r") == 12 and not remote._pending
    anchor, zero = torch.tensor([17]), torch.zeros(1)
    block = remote.draft(["r"], anchor, zero, [None])
    assert [(r.context_only, [(u.context_len, len(u.tokens)) for u in r.sequences]) for r in sent] == [
        (True, [(0, 7)]), (True, [(5, 7)]), (False, [(12, 0)])]  # the draft carried no context rows
    local.extend_context("r", feats, toks)
    assert torch.equal(block.tokens, local.draft(["r"], anchor, zero, [None]).tokens)


class _CountingRemote:
    """A local drafter that says it is remote and counts the pushes the engine makes."""
    remote = True

    def __init__(self, local):
        self.local, self.pushes = local, []

    def __getattr__(self, name):
        return getattr(self.local, name)

    def push(self):
        self.pushes.append(self.steps)


@pytest.mark.parametrize("every", [0, 1, 4])
def test_while_no_draft_is_asked_for_the_context_goes_every_nth_step(every):
    """--context-push-every: a verifier that skips the drafter pushes only every N-th step, one
    that drafts pushes after every step, and what the requests decode does not change."""
    from dspark.speculative.engine import SpecEngine
    from dspark.speculative.policy import FixedDraftLen
    from spec_helpers import greedy_reference

    target = tiny_target()
    prompts = [[5, 9, 11, 3], [7, 2, 8]]
    for draft_len in (0, 3):
        drafter = _CountingRemote(random_drafter(target, "dspark", gamma=3))
        engine = SpecEngine(target, drafter, FixedDraftLen(draft_len), context_push_every=every, max_batch=2,
                            max_len=128)
        seqs = [engine.add(p, SamplingParams(max_tokens=24)) for p in prompts]
        drafter.steps, drafted = 0, []
        while engine.has_work():
            drafter.steps += 1
            engine.step()
            drafted.append(engine.last_report.drafted)
        assert [s.output for s in seqs] == greedy_reference(target, prompts, 24)
        expected, skipped = [], 0  # a step that drafted pushes; otherwise every N-th step in a row
        for step, did in enumerate(drafted, 1):
            skipped = 0 if did else skipped + 1
            if skipped == 0 or (every and skipped % every == 0):
                expected.append(step)
        assert drafter.pushes == expected, (draft_len, drafted, drafter.pushes)
        assert any(drafted) == (draft_len > 0)
        assert len(expected) >= ((len(drafted) // every if every else 0) if draft_len == 0 else len(drafted) - 2)


def _wait_probe(remote, timeout_s: float = 30.0):
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = remote.probe_result()
        if answer is not None:
            return answer
        time.sleep(0.005)
    raise AssertionError("the probe was never answered")


def test_a_probe_returns_at_once_and_its_confidences_are_a_drafts(drafter_service, remote):
    """probe() sends the unsent context with the anchors and does not wait; probe_result() later
    gives the confidences and tokens the same context drafts locally; one probe in flight at a time."""
    local, sent = _service_weights(drafter_service[0]), remote.sent
    width = len(local.ctx_layers) * local.cfg.hidden_size
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(9, width, generator=g).bfloat16().float()
    toks = torch.randint(0, local.cfg.vocab_size, (9,), generator=g)
    anchor, zero = torch.tensor([11]), torch.zeros(1)
    remote.extend_context("r", feats, toks)
    assert remote.probe(["r"], anchor, zero) and remote.probe(["r"], anchor, zero)
    assert len(sent) == 1 and not sent[0].context_only and sent[0].sequences[0].context_len == 0
    assert remote.context_len("r") == 9 and not remote._pending  # sent, as a push leaves it
    req_ids, conf, tokens = _wait_probe(remote)
    local.extend_context("r", feats, toks)
    local_block = local.draft(["r"], anchor, zero, [None])
    expected = local_block.conf_logits
    assert req_ids == ["r"] and torch.allclose(conf, expected, atol=1e-4)
    assert torch.equal(tokens, local_block.tokens)  # greedy: the tokens the target will check
    assert remote.probe_result() is None  # taken once
    block = remote.draft(["r"], anchor, zero, [None])  # the probe left the context in place
    assert sent[-1].sequences[0].context_len == 9 and not sent[-1].sequences[0].tokens
    assert torch.allclose(block.conf_logits, expected, atol=1e-4)


def test_a_verifier_whose_budget_is_zero_probes_in_the_background(drafter_service, remote):
    """Budget 0 from the scheduler: no step waits for a draft, probes still go out, their
    confidences reach the step reports as unverified drafts, and the text is the target's."""
    import time

    from dspark.models.loader import load_model
    from dspark.sched.budget_source import ScheduledBudget
    from dspark.speculative.engine import SpecEngine
    from dspark.speculative.policy import ConfidencePolicy
    from spec_helpers import greedy_reference

    target = load_model(str(drafter_service[0])).model
    source = ScheduledBudget(default_draft_len=3)
    source.push(0)
    engine = SpecEngine(target, remote, ConfidencePolicy(source, probe_every=2), max_batch=2, max_len=128)
    prompts = [[5, 9, 11, 3], [7, 2, 8]]
    seqs = [engine.add(p, SamplingParams(max_tokens=32)) for p in prompts]
    reports = []
    while engine.has_work():
        engine.step()
        reports.append(engine.last_report)
        time.sleep(0.005)  # a step of this tiny target is shorter than a round trip
    assert [s.output for s in seqs] == greedy_reference(target, prompts, 32)
    assert not any(r.drafted for r in reports)
    probed = [r for r in reports if r.req_ids]
    assert probed, "no probe answer reached a step report"
    for r in probed:
        assert r.verified == [0] * len(r.req_ids) and r.accepted == r.verified
        assert r.conf_logits.shape == (len(r.req_ids), remote.gamma) and torch.isfinite(r.conf_logits).all()
    # Greedy: the target later decides what each probe guessed, and the outcomes come back.
    checked = [r for r in reports if r.checked_conf is not None]
    assert checked, "no probe was checked against the target"
    for r in checked:
        assert r.checked_conf.shape == (len(r.checked_verified), remote.gamma)
        assert all(0 <= a <= v <= remote.gamma and v >= 1 for a, v in zip(r.checked_accepted, r.checked_verified))


def test_lookup_in_front_of_the_remote_drafter_skips_the_round_trip_and_keeps_the_text(drafter_service, remote):
    """The verifier's prompt lookup: blocks it answers never go to the drafter service, whose context
    catches up when it is next asked; the greedy text is the target's."""
    from dspark.drafters.lookup import LookupDrafter
    from dspark.engine.generate import Engine
    from dspark.models.loader import load_model
    from dspark.speculative.engine import SpecEngine
    from dspark.speculative.policy import FixedDraftLen

    target = load_model(str(drafter_service[0])).model
    prompts = [[5, 9, 11, 3, 5, 9, 11, 3, 5, 9], [7, 2, 8, 4, 7, 2, 8]]  # repeated phrases: lookup finds them
    reference = [s.output for s in Engine(target, max_batch=2, max_len=128).generate(
        prompts, SamplingParams(max_tokens=24))]
    drafter = LookupDrafter(remote)
    engine = SpecEngine(target, drafter, FixedDraftLen(3), max_batch=2, max_len=128)
    seqs = [engine.add(p, SamplingParams(max_tokens=24)) for p in prompts]
    drafted = 0
    while engine.has_work():
        engine.step()
        drafted += engine.last_report.drafted
    assert [s.output for s in seqs] == reference
    drafts_sent = sum(not r.context_only and not any(u.ahead for u in r.sequences) for r in remote.sent)
    assert sum(map(sum, drafter.stats.tries)) > 0 and drafts_sent < drafted  # some steps never asked the service


def test_the_drafter_service_looks_up_itself_when_asked(drafter_service):
    """drafter_svc --lookup=on (for verifiers that do not look up): a repeated phrase is answered by
    lookup, point masses; the flag's default leaves the drafter alone."""
    path = drafter_service[0]
    plain = load(parse_args([f"--target-model={path}", "--gamma=4", "--num-layers=1"]))[0]
    drafter = load(parse_args([f"--target-model={path}", "--gamma=4", "--num-layers=1", "--lookup=on"]))[0]
    assert not hasattr(plain, "stats") and hasattr(drafter, "stats")
    width = len(drafter.ctx_layers) * drafter.cfg.hidden_size
    keys, limits = OrderedDict(), Limits(drafter.cfg.vocab_size)
    request = drafter_pb2.DraftRequest(step=1, sequences=[drafter_pb2.SequenceUpdate(
        request_id="r", tokens=[7, 8, 9, 7, 8], context_len=0, anchor_token=9,
        hidden=tensor_to_proto(torch.randn(5, width).bfloat16()))])
    reply = answer(drafter, 1, keys, request, width, limits)
    assert list(reply.sequences[0].tokens) == [7, 8, 9, 7]  # (8, 9) was followed by 7, 8, then the loop


def test_a_draft_ahead_drafts_past_the_context_and_leaves_it_as_it_was():
    drafter = random_drafter(tiny_target(), "dspark", gamma=3)
    width = len(drafter.ctx_layers) * drafter.cfg.hidden_size
    keys, limits = OrderedDict(), Limits(drafter.cfg.vocab_size)
    assert answer(drafter, 1, keys, drafter_pb2.DraftRequest(step=1, context_only=True, sequences=[
        _update("a", 6, 0, width)]), width, limits) is None
    request = drafter_pb2.DraftRequest(step=2, sequences=[drafter_pb2.SequenceUpdate(
        request_id="a", context_len=6, anchor_token=9, ahead=2)])
    ahead = answer(drafter, 1, keys, request, width, limits).sequences[0]
    assert drafter.context_len("1:a") == 6  # nothing of the guess enters the context
    local = drafter.draft(["1:a"], torch.tensor([9]), torch.zeros(1), [None], gaps=[2])  # anchor at position 8
    assert list(ahead.tokens) == local.tokens[0].tolist()
    assert torch.equal(tensor_from_proto(ahead.confidence_logits), local.conf_logits[0])
    far = drafter_pb2.DraftRequest(step=3, sequences=[drafter_pb2.SequenceUpdate(
        request_id="a", context_len=6, anchor_token=9, ahead=limits.max_len)])
    with pytest.raises(WireError, match="at most"):  # an anchor past the longest context is refused
        answer(drafter, 1, keys, far, width, limits)
    # EAGLE-3 drafts step by step from its own features: nothing to draft ahead from.
    eagle = random_drafter(tiny_target(), "eagle3", gamma=3)
    assert not eagle.drafts_ahead
    with pytest.raises(WireError, match="does not draft ahead"):
        answer(eagle, 1, OrderedDict(), request, len(eagle.ctx_layers) * eagle.cfg.hidden_size,
               Limits(eagle.cfg.vocab_size))


def test_the_remote_drafter_takes_a_row_drafted_ahead_when_its_guess_held(drafter_service, remote):
    """Two requests drafted ahead; after the step one has the guessed anchor at the guessed position,
    the other not: the first row comes from the draft ahead, only the second is asked for."""
    local, sent = _service_weights(drafter_service[0]), remote.sent
    width = len(local.ctx_layers) * local.cfg.hidden_size
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(9, width, generator=g).bfloat16().float()
    toks = torch.randint(0, local.cfg.vocab_size, (9,), generator=g)
    for r in ("r1", "r2"):
        remote.extend_context(r, feats[:7], toks[:7])
    remote.draft_ahead(["r1", "r2"], [17, 18], [2, 2], [0.0, 0.0])  # guesses: anchor 17 / 18 at position 9
    for r in ("r1", "r2"):  # the step decided positions 7 and 8
        remote.extend_context(r, feats[7:], toks[7:])
    block = remote.draft(["r1", "r2"], torch.tensor([17, 5]), torch.zeros(2), [None, None])
    assert [[(u.request_id, u.context_len, len(u.tokens), u.ahead) for u in r.sequences] for r in sent] == [
        [("r1", 0, 7, 2), ("r2", 0, 7, 2)],  # the draft ahead carried the unsent context
        [("r2", 7, 2, 0)]]  # r2's guess failed: drafted afresh; r1 was not asked for
    for r in ("r1", "r2"):
        local.extend_context(r, feats[:7], toks[:7])
    want_r1 = local.draft(["r1"], torch.tensor([17]), torch.zeros(1), [None], gaps=[2])
    local.extend_context("r2", feats[7:], toks[7:])
    want_r2 = local.draft(["r2"], torch.tensor([5]), torch.zeros(1), [None])
    assert block.tokens.tolist() == [want_r1.tokens[0].tolist(), want_r2.tokens[0].tolist()]
    assert remote.context_len("r1") == 9 and remote.context_len("r2") == 9
    remote.push()  # r1's new positions go with the push, as after any step
    assert [(u.request_id, u.context_len, len(u.tokens)) for u in sent[-1].sequences] == [("r1", 7, 2)]
    # An answer drafted ahead is used once: the next draft is a fresh one.
    remote.draft(["r1"], torch.tensor([17]), torch.zeros(1), [None])
    assert [(u.request_id, u.context_len, len(u.tokens), u.ahead) for u in sent[-1].sequences] == [("r1", 9, 0, 0)]


def test_drafting_ahead_with_the_shipped_drafter_keeps_the_greedy_text(smollm2, tmp_path, monkeypatch):
    """The real target and the shipped DSpark drafter in a drafter service, 2 of 7 drafts verified a
    step, two requests in the batch: blocks drafted ahead are used (some steps wait for no draft,
    some merge rows drafted ahead with fresh ones) and the text is plain greedy decoding's."""
    from dspark.drafters.shipped import default_drafter_dir
    from dspark.engine.generate import Engine
    from dspark.serving import metrics
    from dspark.speculative.engine import SpecEngine
    from dspark.speculative.policy import FixedDraftLen

    service, address = start_drafter(smollm2.name, tmp_path, checkpoint=str(default_drafter_dir(smollm2.name)))
    try:
        wait_serving(address, service, timeout=300)
        monkeypatch.setenv("DSPARK_INTERNAL_TOKEN", TOKEN)
        config.reset_peer_settings()
        remote = RemoteDrafter(address, timeout_s=30)
        assert remote.connect(60) and remote.drafts_ahead
        questions = ["What is 12 times 7? Think step by step.", "Write a Python function that adds two numbers."]
        prompts = [smollm2.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
        params = SamplingParams(max_tokens=64)
        reference = [s.output for s in Engine(smollm2.model, max_batch=2, max_len=1024).generate(prompts, params)]
        used = metrics.DRAFTS_AHEAD_USED._value.get()
        engine = SpecEngine(smollm2.model, remote, FixedDraftLen(2), max_batch=2, max_len=1024)
        seqs = [engine.add(p, params) for p in prompts]
        while engine.has_work():
            engine.step()
        remote.close()
    finally:
        service.terminate(30)
    assert [s.output for s in seqs] == reference
    assert metrics.DRAFTS_AHEAD_USED._value.get() - used > 0
