"""Bad input gets the right status and the services keep serving (a valid request right after
each bad one succeeds). Real processes on localhost, tiny target written here."""
from __future__ import annotations

import queue

import grpc
import pytest
import torch
from dspark_client import Client, DSparkError, RetryPolicy
from grpc_health.v1 import health_pb2
from service_helpers import (AUTH, RedisServer, health_status, internal_channel, start_drafter, start_scheduler,
                             start_verifier, wait_registered, wait_serving, wait_until, write_tiny_target)

from dspark.proto_gen.v1 import (drafter_pb2, drafter_pb2_grpc, generation_pb2_grpc, tensor_pb2, verifier_pb2,
                                 verifier_pb2_grpc)
from dspark.proto_gen.v1 import generation_pb2 as pb
from dspark.wire import tensor_to_proto

pytestmark = pytest.mark.slow
MAX_LEN = 256


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    # A Redis of its own: on a shared one, verifiers of other runs register and get our requests.
    redis_server = RedisServer().start()
    path = str(write_tiny_target(tmp_path_factory.mktemp("tiny") / "tiny"))
    drafter, d_addr = start_drafter(path, logs)
    scheduler, s_addr = start_scheduler(logs, [], redis_url=redis_server.url, max_message_mb=1)
    # explore=1 and a draft every step: every request verifies its full block whatever K the
    # scheduler picks (on a tiny target drafting never pays, so K = 0 would skip the drafter),
    # so the checks below can see the drafter at work.
    verifier, v_addr = start_verifier(path, logs, d_addr, s_addr, max_len=MAX_LEN, default_max_tokens=20, explore=1.0,
                                      draft_probe_every=1)
    try:
        for service, address in ((drafter, d_addr), (scheduler, s_addr), (verifier, v_addr)):
            wait_serving(address, service)
        wait_registered(s_addr, 1)
        yield dict(drafter=d_addr, scheduler=s_addr, verifier=v_addr)
    finally:
        for service in (verifier, scheduler, drafter):
            service.kill()
        redis_server.kill()


def assert_serving(client: Client) -> None:
    result = client.generate(token_ids=[5, 6, 7], max_tokens=8)
    assert len(result.token_ids) == 8 and result.finish_reason.value == "length"


BAD = [
    ("empty text prompt", dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT),
    ("empty token prompt", dict(token_ids=[]), grpc.StatusCode.INVALID_ARGUMENT),
    ("empty conversation", dict(messages=[]), grpc.StatusCode.INVALID_ARGUMENT),
    ("prompt longer than the context", dict(token_ids=[5] * MAX_LEN), grpc.StatusCode.OUT_OF_RANGE),
    ("text prompt longer than the context", dict(prompt="w5 " * (MAX_LEN + 10)), grpc.StatusCode.OUT_OF_RANGE),
    ("token id outside the vocabulary", dict(token_ids=[5, 10_000]), grpc.StatusCode.INVALID_ARGUMENT),
    ("negative temperature", dict(prompt="w5", temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT),
    ("top_p above 1", dict(prompt="w5", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT),
    ("negative top_p", dict(prompt="w5", top_p=-0.1), grpc.StatusCode.INVALID_ARGUMENT),
    ("negative top_k", dict(prompt="w5", top_k=-3), grpc.StatusCode.INVALID_ARGUMENT),
    ("unknown model", dict(prompt="w5", model="no-such-model"), grpc.StatusCode.NOT_FOUND),
    ("oversized message", dict(prompt="w5 " * 400_000), grpc.StatusCode.RESOURCE_EXHAUSTED),  # 1.2 MB > 1 MiB
]


@pytest.mark.parametrize("entry", ["scheduler", "verifier"])
def test_bad_requests_get_the_right_status_and_the_server_keeps_serving(cluster, entry):
    metadata = AUTH if entry == "verifier" else ()  # the verifier is internal: it wants the token
    with Client(cluster[entry], timeout=60, retry=RetryPolicy(max_attempts=1), metadata=metadata) as client:
        assert_serving(client)
        for name, request, code in BAD:
            if entry == "verifier" and code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                request = dict(prompt="w5 " * 1_500_000)  # the verifier keeps the default 4 MiB limit
            with pytest.raises(DSparkError) as info:
                client.generate(**request, max_tokens=4)
            assert info.value.code == code, name
            assert_serving(client)


def test_max_tokens_zero_means_the_server_default_and_negative_cannot_be_sent(cluster):
    with Client(cluster["scheduler"], timeout=60) as client:
        # max_tokens is a uint32 on the wire: 0 is "the server's default" (generation.proto) ...
        result = client.generate(token_ids=[5, 6], max_tokens=0)
        assert result.finish_reason.value == "length" and len(result.token_ids) == 20
        # ... and a negative value never leaves the client.
        with pytest.raises(ValueError):
            client.generate(token_ids=[5, 6], max_tokens=-1)


def test_generate_many_keys_chunks_refuses_bad_starts_and_frees_cancelled_slots(cluster):
    """The scheduler's stream to a verifier: chunks of every request that moved come in one
    message a step, keyed; a bad start or a key in use is refused on its key alone (the others
    go on); a cancel frees the request's slot; the text is the one-request Generate's."""
    channel = internal_channel(cluster["verifier"])
    verifier = verifier_pb2_grpc.VerifierStub(channel)

    def start(key: int, **fields) -> verifier_pb2.StreamCommand:
        return verifier_pb2.StreamCommand(key=key, start=verifier_pb2.RoutedGenerateRequest(
            request=pb.GenerateRequest(request_id=f"k{key}", **fields)))

    greedy = dict(token_ids=pb.TokenIds(ids=[5, 6, 7]), max_tokens=12)
    alone = [t for c in verifier.Generate(start(0, **greedy).start, timeout=60) for t in c.token_ids]
    commands = queue.Queue()
    for command in (start(1, **greedy), start(3, token_ids=pb.TokenIds(ids=[5, 6]), max_tokens=200),
                    start(2, token_ids=pb.TokenIds(ids=[5, 10_000])), start(3, **greedy)):
        commands.put(command)
    call = verifier.GenerateMany(iter(commands.get, None), timeout=60)
    tokens, finished, refused, batch_sizes = {1: [], 3: []}, set(), {}, []
    for batch in call:
        batch_sizes.append(len(batch.chunks))
        for item in batch.chunks:
            if not item.HasField("chunk"):
                refused[item.key] = grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == item.status_code))
                continue
            assert item.chunk.offset == len(tokens[item.key]) and item.chunk.request_id == f"k{item.key}"
            tokens[item.key] += item.chunk.token_ids
            if item.chunk.finish_reason:
                finished.add(item.key)
        if len(tokens[3]) >= 4 and 3 not in finished and not commands.qsize():
            commands.put(verifier_pb2.StreamCommand(key=3, cancel=True))
            commands.put(verifier_pb2.StreamCommand(key=4, cancel=True))  # an unknown key: nothing to do
            commands.put(None)  # no more commands: the stream ends once key 1 is done
    assert refused == {2: grpc.StatusCode.INVALID_ARGUMENT, 3: grpc.StatusCode.INVALID_ARGUMENT}
    assert finished == {1} and tokens[1] == alone
    assert 4 <= len(tokens[3]) < 200
    assert max(batch_sizes) >= 2  # keys 1 and 3 moved in the same steps

    def idle() -> bool:
        load = verifier.GetLoad(verifier_pb2.GetLoadRequest(), timeout=10)
        return load.running == 0 and load.queued == 0

    wait_until(idle, 10, what="the cancelled request's slot freed")
    with Client(cluster["scheduler"], timeout=60) as client:
        assert_serving(client)


def _draft_request(width: int, rows: torch.Tensor | None = None, **update) -> drafter_pb2.DraftRequest:
    """One sequence "r1" with 3 new positions; `update` overrides fields (hidden=a raw Tensor proto)."""
    rows = rows if rows is not None else torch.randn(3, width).to(torch.bfloat16)
    fields = dict(request_id="r1", tokens=[5, 6, 7], anchor_token=8, context_len=0, hidden=tensor_to_proto(rows))
    fields.update(update)
    return drafter_pb2.DraftRequest(step=1, sequences=[drafter_pb2.SequenceUpdate(**fields)])


def test_drafter_rejects_malformed_tensors_without_disturbing_other_streams(cluster):
    channel = internal_channel(cluster["drafter"])
    stub = drafter_pb2_grpc.DrafterStub(channel)
    info = stub.DrafterInfo(drafter_pb2.DrafterInfoRequest(), timeout=10)
    width = len(info.target_layers) * info.hidden_size

    def roundtrip(*requests):
        return list(stub.DraftStream(iter(requests), timeout=30))

    # A healthy stream, kept open across the bad ones below.
    import queue
    good_requests: queue.SimpleQueue = queue.SimpleQueue()
    good = stub.DraftStream(iter(good_requests.get, None), timeout=60)
    good_requests.put(_draft_request(width))
    first = next(good)
    assert len(first.sequences[0].tokens) == info.gamma

    truncated = tensor_to_proto(torch.randn(3, width).to(torch.bfloat16))
    truncated.data = truncated.data[:-2]  # bytes do not match bf16 x [3, width]
    mislabelled = tensor_to_proto(torch.randn(3, width).to(torch.bfloat16))
    mislabelled.dtype = tensor_pb2.DTYPE_F32  # f32 x [3, width] needs twice the bytes
    bad = [
        _draft_request(width, hidden=truncated),
        _draft_request(width, hidden=mislabelled),
        _draft_request(width, torch.randn(3, width + 1).to(torch.bfloat16)),  # wrong hidden width
        _draft_request(width, torch.randn(2, width).to(torch.bfloat16)),  # 2 rows for 3 tokens
        _draft_request(width, torch.randint(0, 5, (3, width))),  # integer "hidden states"
    ]
    for request in bad:
        with pytest.raises(grpc.RpcError) as info_:
            roundtrip(request)
        assert info_.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # The good stream still answers, with its context intact (context_len 3 + 1 new row).
        good_requests.put(drafter_pb2.DraftRequest(step=2, sequences=[drafter_pb2.SequenceUpdate(
            request_id="r1", tokens=[8], anchor_token=9, context_len=3,
            hidden=tensor_to_proto(torch.randn(1, width).to(torch.bfloat16)))]))
        answer = next(good)
        assert not answer.sequences[0].context_missing and len(answer.sequences[0].tokens) == info.gamma
        good_requests.put(drafter_pb2.DraftRequest(step=3, sequences=[drafter_pb2.SequenceUpdate(
            request_id="r1", anchor_token=8, context_len=3)]))  # roll the extra row back again
        assert not next(good).sequences[0].context_missing

    # A request for a context this drafter never saw: context_missing, not an error.
    missing = roundtrip(_draft_request(width, tokens=[], hidden=None, context_len=7))
    assert missing[0].sequences[0].context_missing
    good_requests.put(None)
    channel.close()
    # And verifiers still speculate through it.
    with Client(cluster["scheduler"], timeout=60) as client:
        assert client.generate(token_ids=[5, 6, 7], max_tokens=16).metrics.draft_tokens > 0


def test_health_reports_serving_once_loaded(cluster):
    for address in cluster.values():
        assert health_status(address) == health_pb2.HealthCheckResponse.SERVING


def test_list_models_through_the_scheduler(cluster):
    with grpc.insecure_channel(cluster["scheduler"]) as channel:
        models = generation_pb2_grpc.GenerationStub(channel).ListModels(pb.ListModelsRequest(), timeout=5).models
    assert [(m.name, m.drafter, m.gamma, m.max_context_tokens) for m in models] == [("tiny", "dspark", 4, MAX_LEN)]
