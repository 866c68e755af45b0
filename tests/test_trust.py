"""Issue 15, "Trust and isolation": one test per finding, against real services on localhost
(tiny target, random drafter, a Redis of the test's own). Each failed on the code before the fix.

1. a fake verifier registered, or took over a live verifier's id, and got the users' prompts
2. concurrent requests with the same client request_id shared state in verifier and drafter
3. internal services answered anyone (no auth), reflection on, every port on all interfaces
4. bad token ids and undecodable messages: UNKNOWN, dead streams, tracebacks
5. unbounded work: max_tokens, drafter message size, contexts per stream, Redis connections
(6, scheduler failover, is tests/test_scheduler_failover.py.)
"""
from __future__ import annotations

import argparse
import asyncio
import queue

import grpc
import pytest
import torch
from dspark_client import AsyncClient, Client, DSparkError, RetryPolicy
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from service_helpers import (AUTH, RedisServer, internal_address, internal_channel, start_drafter, start_scheduler,
                             start_verifier, wait_registered, wait_serving, wait_until, write_tiny_target)

from dspark.proto_gen.v1 import (drafter_pb2, drafter_pb2_grpc, generation_pb2_grpc, load_pb2, scheduler_pb2,
                                 scheduler_pb2_grpc, verifier_pb2, verifier_pb2_grpc)
from dspark.proto_gen.v1 import generation_pb2 as pb
from dspark.wire import tensor_to_proto

pytestmark = pytest.mark.slow
MAX_LEN = 512
PROMPTS = [[5, 9, 30, 41], [7, 7, 12], [60, 2, 33, 90, 14], [3, 44], [21, 22, 23, 24, 25, 26], [80, 1, 50]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    path = str(write_tiny_target(tmp_path_factory.mktemp("tiny") / "tiny"))
    redis_server = RedisServer().start()
    drafter, d_addr = start_drafter(path, logs)
    scheduler, s_addr = start_scheduler(logs, [], redis_url=redis_server.url, queue_timeout_s=120)
    # A draft every step, the whole block verified: the drafter is at work on every request.
    verifier, v_addr = start_verifier(path, logs, d_addr, s_addr, max_len=MAX_LEN, explore=1.0, draft_probe_every=1)
    try:
        for service, address in ((drafter, d_addr), (scheduler, s_addr), (verifier, v_addr)):
            wait_serving(address, service)
        wait_registered(s_addr, 1)
        with Client(s_addr, timeout=120) as client:
            references = [client.generate(token_ids=p, max_tokens=24).token_ids for p in PROMPTS]
        yield dict(drafter=d_addr, scheduler=s_addr, verifier=v_addr, verifier_id=f"verifier-{v_addr.rsplit(':')[1]}",
                   scheduler_log=scheduler, references=references, redis=redis_server)
    finally:
        for service in (verifier, scheduler, drafter):
            service.kill()
        redis_server.kill()


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def assert_serving(cluster) -> None:
    with Client(cluster["scheduler"], timeout=120) as client:
        assert client.generate(token_ids=PROMPTS[0], max_tokens=24).token_ids == cluster["references"][0]


def load(verifier_id: str) -> load_pb2.VerifierLoad:
    return load_pb2.VerifierLoad(verifier_id=verifier_id, max_batch=16, model="tiny")


# ---- 1. verifier identity --------------------------------------------------------------------

def test_1_a_fake_verifier_can_neither_register_nor_take_over_a_live_one(cluster):
    fake = scheduler_pb2.RegisterVerifierRequest(address="127.0.0.1:9", model="tiny", load=load("evil"))
    # The Scheduler service is not on the public port at all ...
    with grpc.insecure_channel(cluster["scheduler"]) as channel:
        assert code_of(lambda: scheduler_pb2_grpc.SchedulerStub(channel).RegisterVerifier(fake, timeout=10)) \
            == grpc.StatusCode.UNIMPLEMENTED
    # ... and on the internal one nobody without the credential gets in.
    internal = internal_address(cluster["scheduler"])
    with grpc.insecure_channel(internal) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        assert code_of(lambda: stub.RegisterVerifier(fake, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        hijack = scheduler_pb2.HeartbeatRequest(load=load(cluster["verifier_id"]))
        assert code_of(lambda: stub.Heartbeat(hijack, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
    # Even a caller holding the credential cannot move a live verifier's id elsewhere, nor point
    # the scheduler at an address that is not its own.
    with internal_channel(internal) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        takeover = scheduler_pb2.RegisterVerifierRequest(address="127.0.0.1:9", model="tiny",
                                                         load=load(cluster["verifier_id"]))
        assert code_of(lambda: stub.RegisterVerifier(takeover, timeout=10)) == grpc.StatusCode.PERMISSION_DENIED
        elsewhere = scheduler_pb2.RegisterVerifierRequest(address="10.11.12.13:50052", model="tiny", load=load("evil2"))
        assert code_of(lambda: stub.RegisterVerifier(elsewhere, timeout=10)) == grpc.StatusCode.PERMISSION_DENIED
    # Every prompt still reaches the real verifier, with its real answers.
    with Client(cluster["scheduler"], timeout=120) as client:
        for prompt, reference in zip(PROMPTS, cluster["references"]):
            assert client.generate(token_ids=prompt, max_tokens=24).token_ids == reference


# ---- 2. request identity ---------------------------------------------------------------------

@pytest.mark.parametrize("entry", ["scheduler", "verifier"])
def test_2_requests_sharing_a_client_id_never_share_state(cluster, entry):
    metadata = AUTH if entry == "verifier" else ()

    async def run():
        async with AsyncClient(cluster[entry], timeout=120, metadata=metadata,
                               retry=RetryPolicy(max_attempts=1)) as client:
            return await asyncio.gather(*(client.generate(token_ids=p, max_tokens=24, request_id="same-id")
                                          for p in PROMPTS[:4]))

    results = asyncio.run(run())
    for result, reference in zip(results, cluster["references"]):
        assert result.token_ids == reference  # 24 tokens, its own, drafted from its own context
        assert result.request_id == "same-id" and result.finish_reason.value == "length"
        assert result.metrics.draft_tokens > 0


# ---- 3. authentication and safe defaults -----------------------------------------------------

def test_3_internal_services_refuse_callers_without_the_token(cluster):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]), max_tokens=4)
    for metadata in ((), (("dspark-internal-token", "wrong"),)):
        with grpc.insecure_channel(cluster["verifier"]) as channel:
            verifier = verifier_pb2_grpc.VerifierStub(channel)
            generation = generation_pb2_grpc.GenerationStub(channel)
            calls = [
                lambda: verifier.SetVerifyBudget(load_pb2.BudgetDecision(verify_budget=7, decided=True), timeout=10,
                                                 metadata=metadata),
                lambda: verifier.GetLoad(verifier_pb2.GetLoadRequest(), timeout=10, metadata=metadata),
                lambda: list(verifier.Generate(verifier_pb2.RoutedGenerateRequest(request=request), timeout=10,
                                               metadata=metadata)),
                lambda: list(generation.Generate(request, timeout=10, metadata=metadata)),
            ]
            for call in calls:
                assert code_of(call) == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(cluster["drafter"]) as channel:
            drafter = drafter_pb2_grpc.DrafterStub(channel)
            assert code_of(lambda: drafter.DrafterInfo(drafter_pb2.DrafterInfoRequest(), timeout=10,
                                                       metadata=metadata)) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda: list(drafter.DraftStream(iter([drafter_pb2.DraftRequest(step=1)]), timeout=10,
                                                            metadata=metadata))) == grpc.StatusCode.UNAUTHENTICATED
    # With the token they answer.
    with internal_channel(cluster["verifier"]) as channel:
        assert verifier_pb2_grpc.VerifierStub(channel).GetLoad(verifier_pb2.GetLoadRequest(), timeout=10).max_batch == 16


def test_3_reflection_is_off_and_ports_bind_loopback_by_default(cluster):
    for address in (cluster["scheduler"], cluster["verifier"], cluster["drafter"]):
        with internal_channel(address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            assert code_of(lambda: list(stub.ServerReflectionInfo(iter([ask]), timeout=10))) \
                == grpc.StatusCode.UNIMPLEMENTED
    from drafter_svc.__main__ import parse_args as drafter_args
    from scheduler_svc.__main__ import parse_args as scheduler_args
    from verifier_svc.__main__ import parse_args as verifier_args

    for parse in (drafter_args, scheduler_args, verifier_args):
        args = parse([])
        assert args.host == "127.0.0.1" and not args.reflection


def test_3_an_unauthenticated_internal_plane_off_loopback_refuses_to_start(monkeypatch):
    from dspark.serving import config

    for name in ("DSPARK_INTERNAL_TOKEN", "DSPARK_TLS_MUTUAL"):
        monkeypatch.delenv(name, raising=False)
    args = argparse.Namespace(host="0.0.0.0", internal_token="", insecure_internal=False)
    with pytest.raises(SystemExit, match="without authentication"):
        config.apply_auth(args)
    config.apply_auth(argparse.Namespace(host="127.0.0.1", internal_token="", insecure_internal=False))
    config.apply_auth(argparse.Namespace(host="0.0.0.0", internal_token="s3cret,old", insecure_internal=False))
    assert config.internal_tokens() == ["s3cret", "old"]  # the first is sent, both are accepted


# ---- 4. validation ---------------------------------------------------------------------------

def _update(width: int, request_id: str, **fields) -> drafter_pb2.SequenceUpdate:
    base = dict(request_id=request_id, tokens=[5, 6, 7], anchor_token=8, context_len=0,
                hidden=tensor_to_proto(torch.randn(3, width).to(torch.bfloat16)))
    base.update(fields)
    return drafter_pb2.SequenceUpdate(**base)


def test_4_out_of_range_token_ids_are_invalid_argument_and_streams_survive(cluster):
    with internal_channel(cluster["drafter"]) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        info = stub.DrafterInfo(drafter_pb2.DrafterInfoRequest(), timeout=10)
        width = len(info.target_layers) * info.hidden_size
        good_requests: queue.SimpleQueue = queue.SimpleQueue()
        good = stub.DraftStream(iter(good_requests.get, None), timeout=120)
        good_requests.put(drafter_pb2.DraftRequest(step=1, sequences=[_update(width, "g")]))
        assert len(next(good).sequences[0].tokens) == info.gamma
        bad = [dict(anchor_token=-7), dict(anchor_token=10**12), dict(tokens=[5, -1, 7]), dict(tokens=[5, 96, 7])]
        for i, fields in enumerate(bad):
            request = drafter_pb2.DraftRequest(step=1, sequences=[_update(width, "b", **fields)])
            assert code_of(lambda: list(stub.DraftStream(iter([request]), timeout=30))) \
                == grpc.StatusCode.INVALID_ARGUMENT, fields
            good_requests.put(drafter_pb2.DraftRequest(step=2 + i, sequences=[
                drafter_pb2.SequenceUpdate(request_id="g", anchor_token=8, context_len=3)]))
            answer = next(good).sequences[0]
            assert not answer.context_missing and len(answer.tokens) == info.gamma
        good_requests.put(None)

    def generate(stub, request):
        return list(stub(request, timeout=30))

    with grpc.insecure_channel(cluster["scheduler"]) as channel:
        scheduler = generation_pb2_grpc.GenerationStub(channel).Generate
        for bad in (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5]), stop_token_ids=[-1]),
                    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5]), resume=pb.StreamResume(streamed_token_ids=[-3]))):
            assert code_of(lambda: generate(scheduler, bad)) == grpc.StatusCode.INVALID_ARGUMENT
    with internal_channel(cluster["verifier"]) as channel:
        verifier = verifier_pb2_grpc.VerifierStub(channel).Generate
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5]), max_tokens=4)
        for resumed in ([-3], [10**12], [5, 96]):
            routed = verifier_pb2.RoutedGenerateRequest(request=request,
                                                        resume=verifier_pb2.ResumeInfo(streamed_token_ids=resumed))
            assert code_of(lambda: generate(verifier, routed)) == grpc.StatusCode.INVALID_ARGUMENT, resumed
        stops = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5]), stop_token_ids=[96])
        assert code_of(lambda: generate(verifier, verifier_pb2.RoutedGenerateRequest(request=stops))) \
            == grpc.StatusCode.INVALID_ARGUMENT
    assert_serving(cluster)


def test_4_undecodable_messages_are_invalid_argument_with_one_log_line(cluster):
    invalid_utf8 = b"\x1a\x02\xff\xfe"  # field 3 (text) = 2 bytes that are not UTF-8
    corrupt = b"\xff\xff\xff\xff"
    with grpc.insecure_channel(cluster["scheduler"]) as channel:
        # (ListModelsRequest has no fields: unknown ones are skipped, not checked for UTF-8.)
        for method, payloads in (("/dspark.v1.Generation/Generate", (invalid_utf8, corrupt)),
                                 ("/dspark.v1.Generation/ListModels", (corrupt,))):
            for payload in payloads:
                call = (channel.unary_stream if method.endswith("Generate") else channel.unary_unary)(method)
                assert code_of(lambda: list(call(payload, timeout=10)) if method.endswith("Generate")
                               else call(payload, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    with internal_channel(internal_address(cluster["scheduler"])) as channel:
        call = channel.unary_unary("/dspark.v1.Scheduler/RegisterVerifier")
        assert code_of(lambda: call(b"\x0a\x02\xc3\x28", timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    log = cluster["scheduler_log"].log()
    assert "undecodable message" in log and "Traceback" not in log
    assert_serving(cluster)


# ---- 5. bounded work -------------------------------------------------------------------------

def test_5_max_tokens_is_capped_at_the_context(cluster):
    with Client(cluster["scheduler"], timeout=60, retry=RetryPolicy(max_attempts=1)) as client:
        with pytest.raises(DSparkError) as info:
            client.generate(token_ids=[5, 6], max_tokens=2**32 - 1)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "cap" in str(info.value)
        with pytest.raises(DSparkError):
            client.generate(token_ids=[5, 6], max_tokens=MAX_LEN + 1)
        assert len(client.generate(token_ids=[5, 6], max_tokens=8).token_ids) == 8


def test_5_drafter_messages_and_contexts_per_stream_are_bounded(cluster):
    from drafter_svc.__main__ import message_mb

    with internal_channel(cluster["drafter"]) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        info = stub.DrafterInfo(drafter_pb2.DrafterInfoRequest(), timeout=10)
        width = len(info.target_layers) * info.hidden_size
        # Larger than a full batch of full contexts (16 x 2048 positions, bf16): refused by size.
        limit = message_mb(16, 2048, width) * (1 << 20)
        rows = int(limit // (width * 2)) + 1024
        big = drafter_pb2.DraftRequest(step=1, sequences=[drafter_pb2.SequenceUpdate(
            request_id="big", tokens=[5] * rows, anchor_token=8,
            hidden=tensor_to_proto(torch.zeros(rows, width, dtype=torch.bfloat16)))])
        assert big.ByteSize() > limit
        assert code_of(lambda: list(stub.DraftStream(iter([big]), timeout=60))) == grpc.StatusCode.RESOURCE_EXHAUSTED

        # One stream opening 3 x 32 contexts and never releasing: the oldest are evicted.
        requests: queue.SimpleQueue = queue.SimpleQueue()
        replies = stub.DraftStream(iter(requests.get, None), timeout=120)
        for i in range(96):
            requests.put(drafter_pb2.DraftRequest(step=i, sequences=[_update(width, f"r{i}")]))
            assert not next(replies).sequences[0].context_missing
        for i, evicted in ((0, True), (40, True), (95, False)):
            requests.put(drafter_pb2.DraftRequest(step=100 + i, sequences=[
                drafter_pb2.SequenceUpdate(request_id=f"r{i}", anchor_token=8, context_len=3)]))
            assert next(replies).sequences[0].context_missing == evicted, i
        requests.put(None)
    assert_serving(cluster)


def test_5_a_flood_of_requests_waits_for_redis_connections_instead_of_exhausting_them(cluster):
    async def run():
        async with AsyncClient(cluster["scheduler"], timeout=300, retry=RetryPolicy(max_attempts=1)) as client:
            return await asyncio.gather(*(client.generate(token_ids=[5 + i % 50, 6], max_tokens=2)
                                          for i in range(200)), return_exceptions=True)

    results = asyncio.run(run())
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, failed[:3]
    assert all(len(r.token_ids) == 2 for r in results)
    log = cluster["scheduler_log"].log()
    assert "Too many connections" not in log and "store unreachable" not in log
    # Each waiting request leaves the pending list in the background, after it was put there.
    redis = cluster["redis"].client()
    wait_until(lambda: redis.llen("dspark:queue:pending") == 0, timeout=10, what="an empty pending list")
