"""The plain pieces under the services, in process: text streaming, routing, stores, drafter contexts."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from spec_helpers import random_drafter, tiny_target

from drafter_svc.contexts import Limits, answer
from dspark.proto_gen.v1 import drafter_pb2
from dspark.serving.textstream import TextStream
from dspark.wire import WireError, tensor_to_proto
from scheduler_svc.registry import choose
from scheduler_svc.store import MemoryStore, RedisStore

WORDS = ["a", "b", "STOP", "c"]


def decode(ids):
    return " ".join(WORDS[i] for i in ids)


def test_text_stream_holds_back_a_possible_stop_string_and_cuts_at_it():
    stream = TextStream(decode, stop=[" ST"])
    assert stream.push([0, 1]) == ("a b", False)
    delta, hit = stream.push([2])  # "a b STOP": the stop string " ST" begins right after "a b"
    assert (delta, hit) == ("", True)
    plain = TextStream(decode)
    assert "".join(plain.push([i])[0] for i in [0, 1, 3]) + plain.push([], final=True)[0] == "a b c"


def test_text_stream_drops_the_tokens_of_a_burst_after_the_stop_string():
    stream = TextStream(decode, stop=["STOP"])
    assert stream.push([0]) == ("a", False)
    assert stream.push([1, 2, 3, 1]) == (" b ", True)  # one burst: "b STOP c b"; the stop ends at its 2nd token
    assert stream.overshoot == 2 and stream.tokens == [0, 1, 2]
    whole = TextStream(decode, stop=["STOP"])
    assert whole.push([0, 1, 2]) == ("a b ", True) and whole.overshoot == 0


def test_text_stream_resumes_after_already_streamed_text():
    stream = TextStream(decode, prefix_tokens=[0, 1], prefix_text="a b")
    assert stream.push([3]) == (" c", False)


class CancelRecorder:
    """The engine runner as ActiveRequest sees it: only cancel(), recorded."""

    def __init__(self):
        self.cancelled = []

    def cancel(self, job) -> None:
        self.cancelled.append(job)


def active_request(interval_s: float, stop=()):
    from types import SimpleNamespace

    from opentelemetry.trace import INVALID_SPAN

    from verifier_svc.service import ActiveRequest

    job = SimpleNamespace(seq=SimpleNamespace(spec=SimpleNamespace(metrics=None)))
    return ActiveRequest(CancelRecorder(), job, "r1", TextStream(decode, stop=list(stop)), 0, 3, None, 0.0,
                         INVALID_SPAN, interval_s)


@pytest.mark.parametrize("interval_s", [0.0, 3600.0])
def test_held_chunks_carry_every_token_once_and_never_hold_the_first_or_the_last(interval_s):
    from dspark.proto_gen.v1 import generation_pb2 as pb
    from verifier_svc.runner import Event

    active = active_request(interval_s)
    events = [Event([0]), Event([1, 3]), Event([0]), Event([1], "length")]
    sent = [c for c in map(active.chunk, events) if c is not None]
    assert active.done
    assert [t for c in sent for t in c.token_ids] == [0, 1, 3, 0, 1]
    assert "".join(c.text for c in sent) == "a b c a b"
    assert [c.offset for c in sent] == [0, *(sum(len(c.token_ids) for c in sent[:i]) for i in range(1, len(sent)))]
    assert sent[0].token_ids == [0] and sent[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert sent[-1].metrics.generated_tokens == 5
    assert len(sent) == (4 if interval_s == 0 else 2)  # an hour's interval: the first chunk, then the last


def test_a_stop_string_in_held_tokens_ends_the_request_at_once():
    from dspark.proto_gen.v1 import generation_pb2 as pb
    from verifier_svc.runner import Event

    active = active_request(3600.0, stop=["STOP"])
    assert active.chunk(Event([0])).token_ids == [0]
    assert active.chunk(Event([1])) is None  # held
    last = active.chunk(Event([2, 3]))  # the stop string: sent now, the engine told to stop
    assert active.done and active.runner.cancelled == [active.job]
    assert list(last.token_ids) == [1, 2] and last.offset == 1 and last.text == " b "
    assert last.finish_reason == pb.FINISH_REASON_STOP



def test_the_engine_thread_holds_tokens_for_the_chunk_interval_and_never_the_first_or_the_last():
    """Job.release: what the engine thread hands the event loop after a step. Held tokens go out
    together, in order, once the interval has passed; the first delivery and the final one go at once."""
    from verifier_svc.runner import Job

    job = Job(request=None, loop=None, hold_s=0.5)
    assert job.release([1], now=10.0) == [1]  # the first token: at once (time to first token)
    assert job.release([2, 3], now=10.2) is None and job.release([4], now=10.4) is None
    assert job.release([5], now=10.5) == [2, 3, 4, 5]
    assert job.release([6], now=10.6) is None
    assert job.release([7], now=10.7, final=True) == [6, 7]
    every_step = Job(request=None, loop=None)  # hold_s 0: stop strings to check, or a chunk a step
    assert [every_step.release([t], now=1.0) for t in range(3)] == [[0], [1], [2]]

def test_choose_picks_the_least_loaded_verifier_with_room():
    records = [dict(address="a", running=3, queued=0, max_batch=4), dict(address="b", running=1, queued=1, max_batch=4),
               dict(address="c", running=4, queued=0, max_batch=4)]
    assert choose(records, {}) == "b"
    assert choose(records, {"b": 4}) == "a"  # what we routed since its last heartbeat counts too
    assert choose(records, {"a": 4, "b": 4}) is None  # all full: the request queues
    # c reported itself full, but two of ours ended there since: their slots are free now
    assert choose(records, {"a": 4, "b": 4, "c": 2}, {"c": 2}) == "c"
    assert choose(records, {"a": 4, "b": 4, "c": 4}, {"c": 2}) is None  # unless we have filled them again


def test_a_heartbeat_replaces_what_ended_since_the_last_one():
    from scheduler_svc.registry import Registry

    registry = Registry(MemoryStore())
    registry.background = lambda coro, after=None: coro.close()  # no event loop here: skip the store
    registry.heartbeat(dict(verifier_id="v", address="a", running=4, queued=0, max_batch=4))
    registry.inflight["a"] = 4
    assert registry.choose() is None
    registry.finish("a")
    assert registry.choose() == "a" and registry.inflight["a"] == 3
    registry.heartbeat(dict(verifier_id="v", address="a", running=4, queued=0, max_batch=4))  # one more came
    assert registry.choose() is None  # from another scheduler: full again


@pytest.mark.parametrize("make", [MemoryStore, lambda: RedisStore("redis://127.0.0.1:6379/0")])
async def test_store_registry_ttl_and_pending_queue(make):
    store = make()
    if isinstance(store, RedisStore):
        await store.redis.delete("dspark:queue:pending")
    await store.put_verifier("unit-v1", {"address": "x:1"}, ttl_s=0.3)
    assert (await store.verifiers())["unit-v1"] == {"address": "x:1"}
    await store.push_pending("r1")
    await store.push_pending("r2")
    await store.remove_pending("r1")
    assert await store.pending_len() == 1
    await store.remove_pending("r2")
    import asyncio
    await asyncio.sleep(0.4)
    assert "unit-v1" not in await store.verifiers()  # the heartbeat TTL expired
    await store.close()


async def test_a_request_leaves_the_pending_list_even_when_its_removal_is_issued_before_its_push_lands():
    import asyncio

    from scheduler_svc.registry import Registry

    class SlowPushStore(MemoryStore):  # a push still in flight when the request already got a verifier
        async def push_pending(self, request_id):
            await asyncio.sleep(0.05)
            await super().push_pending(request_id)

    registry = Registry(SlowPushStore())
    push = registry.background(registry.store.push_pending("r1"))
    await registry.background(registry.store.remove_pending("r1"), after=push)
    assert await registry.store.pending_len() == 0
    assert registry.store_ok


def test_drafting_ahead_by_default_only_where_the_drafter_has_its_own_cores():
    from verifier_svc.remote_drafter import ahead_pays

    assert not ahead_pays("127.0.0.1:50053", 2) and not ahead_pays("localhost:50053", 4)
    assert not ahead_pays("[::1]:50053", 2) and not ahead_pays("unix:/tmp/drafter.sock", 2)
    assert ahead_pays("127.0.0.1:50053", 16)  # a big machine has cores to spare
    assert ahead_pays("10.0.3.7:50053", 2) and ahead_pays("drafter.dspark.svc.cluster.local:50053", 2)


def _update(req, n, ctx, width, anchor=3, **kw):
    return drafter_pb2.SequenceUpdate(request_id=req, tokens=list(range(5, 5 + n)), anchor_token=anchor,
                                      context_len=ctx, hidden=tensor_to_proto(torch.randn(n, width).bfloat16()), **kw)


def test_drafter_contexts_extend_roll_back_release_and_report_missing():
    drafter = random_drafter(tiny_target(), "dspark", gamma=3)
    width = len(drafter.ctx_layers) * drafter.cfg.hidden_size
    keys = OrderedDict()
    limits = Limits(drafter.cfg.vocab_size)
    reply = answer(drafter, 1, keys, drafter_pb2.DraftRequest(step=1, sequences=[_update("a", 4, 0, width)]), width, limits)
    assert reply.step == 1 and len(reply.sequences[0].tokens) == 3 and drafter.context_len("1:a") == 4
    # Roll back 2 rejected positions and append 1: 3 positions.
    answer(drafter, 1, keys, drafter_pb2.DraftRequest(step=2, sequences=[_update("a", 1, 2, width)]), width, limits)
    assert drafter.context_len("1:a") == 3
    # The same id on another stream is another context; asking past what it holds: context_missing.
    request = drafter_pb2.DraftRequest(step=1, sequences=[_update("a", 1, 3, width)])
    reply = answer(drafter, 2, OrderedDict(), request, width, limits)
    assert reply.sequences[0].context_missing
    answer(drafter, 1, keys, drafter_pb2.DraftRequest(step=3, sequences=[
        drafter_pb2.SequenceUpdate(request_id="a", release=True)]), width, limits)
    assert drafter.context_len("1:a") == 0 and not keys
    with pytest.raises(WireError):  # a bad sequence rejects the whole request before anything changes
        answer(drafter, 1, keys, drafter_pb2.DraftRequest(step=4, sequences=[
            _update("b", 2, 0, width), _update("c", 2, 0, width + 1)]), width, limits)
    assert drafter.context_len("1:b") == 0


def test_drafter_stream_evicts_its_least_recently_used_context_past_the_limit():
    drafter = random_drafter(tiny_target(), "dspark", gamma=3)
    width = len(drafter.ctx_layers) * drafter.cfg.hidden_size
    keys, limits = OrderedDict(), Limits(drafter.cfg.vocab_size, max_batch=2, max_contexts=2)
    for req in ("a", "b"):
        answer(drafter, 1, keys, drafter_pb2.DraftRequest(step=1, sequences=[_update(req, 2, 0, width)]), width, limits)
    answer(drafter, 1, keys, drafter_pb2.DraftRequest(step=2, sequences=[_update("a", 1, 2, width)]), width, limits)
    answer(drafter, 1, keys, drafter_pb2.DraftRequest(step=3, sequences=[_update("c", 2, 0, width)]), width, limits)
    assert list(keys) == ["1:a", "1:c"] and drafter.context_len("1:b") == 0  # b was the least recently used
    assert drafter.context_len("1:a") == 3
    with pytest.raises(WireError, match="outside the vocabulary"):
        answer(drafter, 1, keys, drafter_pb2.DraftRequest(step=4, sequences=[
            _update("a", 1, 3, width, anchor=drafter.cfg.vocab_size)]), width, limits)
    with pytest.raises(WireError, match="at most 2"):
        answer(drafter, 1, keys, drafter_pb2.DraftRequest(step=5, sequences=[
            _update(r, 1, 0, width) for r in ("x", "y", "z")]), width, limits)


def test_text_stream_decodes_incrementally_what_a_whole_decode_gives(smollm2):
    """Bursts of 1-8 tokens from random ids (byte pieces that split characters included) and from
    real text with emoji, CJK and punctuation the tokenizer cleans up: the deltas joined are the
    whole decode at every push (bar a held-back partial character), and a stop string inside a
    burst cuts at the same place as in the whole text."""
    import random

    tok = smollm2.tokenizer
    rng = random.Random(0)
    text = "Hello, world! naïve café 你好 🙂🙂 don't stop . . . it's 3.14 -- ok?\n```py\nx = 1\n```"
    streams = [tok.encode(text * 3), [rng.randrange(tok.vocab_size) for _ in range(600)]]
    for ids in streams:
        stream, sent, i = TextStream(tok.decode), "", 0
        while i < len(ids):
            burst = ids[i:i + rng.randint(1, 8)]
            i += len(burst)
            delta, hit = stream.push(burst, final=i >= len(ids))
            sent += delta
            whole = tok.decode(ids[:i])
            assert not hit and whole.startswith(sent)
            assert len(whole) - len(sent) <= len(whole) - len(whole.rstrip("\ufffd"))
        assert sent == tok.decode(ids)
    stream = TextStream(tok.decode, stop=["café"])
    sent, hit, i = "", False, 0
    while not hit:  # the stream ends at a stop
        delta, hit = stream.push(streams[0][i:i + 5])
        sent, i = sent + delta, i + 5
    assert sent == text[:text.index("café")] and tok.decode(stream.tokens).endswith("café")


def test_text_stream_keeps_the_spaces_a_metaspace_decoder_strips_at_the_start():
    """SentencePiece-style decoders drop the leading space of a sequence's first word: decoding a
    push's tokens alone would glue the words together; its context tokens keep the space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "again", "and", "again"]
    tok.train_from_iterator([" ".join(words)] * 4, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"]))
    ids = tok.encode(" ".join(words * 2)).ids
    stream = TextStream(tok.decode)
    sent = "".join(stream.push(ids[i:i + 3])[0] for i in range(0, len(ids), 3)) + stream.push([], final=True)[0]
    assert sent == " ".join(words * 2)


def test_an_idle_engine_admits_a_burst_of_requests_into_one_pass():
    """Requests arriving close together at an idle engine prefill in one pass (first tokens at once
    for all of them); one arriving after a quiet gap starts a pass of its own."""
    import asyncio
    import concurrent.futures
    import time

    from spec_helpers import tiny_target

    from dspark.sampling import SamplingParams
    from dspark.speculative.engine import EngineRequest, SpecEngine
    from verifier_svc.runner import EngineRunner, Job

    steps = []  # (requests in the pass, was it a prefill)
    # Gaps far wider than the arrivals' spacing, so a loaded host cannot split the burst.
    runner = EngineRunner(SpecEngine(tiny_target(), None, max_batch=8, max_len=64),
                          lambda report: steps.append((report.batch_size, report.prefill)),
                          admission_quiet_s=0.5, admission_window_s=5.0)
    loop = asyncio.new_event_loop()
    executor = concurrent.futures.ThreadPoolExecutor(1)
    runner.start(executor)
    try:
        def job(i):
            return Job(EngineRequest([1 + i, 2, 3], SamplingParams(max_tokens=3), f"r{i}"), loop)

        for i in range(4):  # a burst: each within the quiet gap of the last
            runner.submit(job(i))
            time.sleep(0.02)
        deadline = time.monotonic() + 30
        while (runner.running or runner.queued) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert steps[0] == (4, True)  # all four in the first pass
        steps.clear()
        runner.submit(job(4))
        deadline = time.monotonic() + 30
        while not steps and time.monotonic() < deadline:
            time.sleep(0.01)
        assert steps[0] == (1, True)  # alone, after the quiet gap
    finally:
        runner.stop()
        executor.shutdown()
        loop.close()
