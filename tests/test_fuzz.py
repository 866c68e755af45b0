"""Mutated messages on every RPC of the three services (real processes, tiny target): each call
ends with a documented status, never UNKNOWN or INTERNAL, no service logs a traceback, and all
of them keep serving. Seeded, so a failure replays.

A valid message of each RPC is mutated, half of the time field by field (a scalar set to an
extreme value: negative, huge, NaN, inf, empty, long; a repeated field emptied or given an
extreme element), so the mutant decodes and the validation must catch it, and half of the
time byte by byte (a byte changed, cut, inserted, dropped or repeated; a varint made huge),
which mostly yields messages that do not decode. Internal RPCs are sent with the token
(an attacker without it stops at UNAUTHENTICATED, tests/test_trust.py), so the fuzz reaches
their validation.
"""
from __future__ import annotations

import collections
import random

import grpc
import pytest
import torch
from dspark_client import Client
from google.protobuf.descriptor import FieldDescriptor
from service_helpers import (TOKEN, internal_address, start_drafter, start_scheduler, start_verifier, wait_registered,
                             wait_serving, wait_until, write_tiny_target)

from dspark.proto_gen.v1 import drafter_pb2, load_pb2, scheduler_pb2, verifier_pb2
from dspark.proto_gen.v1 import generation_pb2 as pb
from dspark.wire import tensor_to_proto

pytestmark = pytest.mark.slow
PER_RPC = 100
SEED = 15
# What a bad message may get back (docs/deploy.md, "Status codes"); CANCELLED is our own cancel
# of a stream after its first answer, UNAVAILABLE the scheduler's "no verifier with room" when a
# mutated heartbeat made the verifier look full for a moment.
DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.INVALID_ARGUMENT,
              grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    path = str(write_tiny_target(tmp_path_factory.mktemp("tiny") / "tiny"))
    drafter, d_addr = start_drafter(path, logs)
    scheduler, s_addr = start_scheduler(logs, [], queue_timeout_s=5)
    verifier, v_addr = start_verifier(path, logs, d_addr, s_addr, max_len=256, explore=1.0, draft_probe_every=1)
    services = (drafter, scheduler, verifier)
    try:
        for service, address in zip(services, (d_addr, s_addr, v_addr)):
            wait_serving(address, service)
        wait_registered(s_addr, 1)
        yield dict(drafter=d_addr, scheduler=s_addr, internal=internal_address(s_addr), verifier=v_addr,
                   verifier_id=f"verifier-{v_addr.rsplit(':', 1)[1]}", services=services)
    finally:
        for service in services:
            service.kill()


def valid_messages(cluster) -> list[tuple[str, str, str, bytes]]:
    """(address key, method, kind, serialized valid message) for every RPC."""
    request = pb.GenerateRequest(
        request_id="fuzz", token_ids=pb.TokenIds(ids=[5, 9, 30]), max_tokens=6, stop=["w7"], stop_token_ids=[3],
        sampling=pb.SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=4),
        speculation=pb.SpeculationOverride(max_draft_tokens=2), resume=pb.StreamResume(streamed_token_ids=[8]))
    chat = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="w5 w6")]),
                              max_tokens=4)
    load = load_pb2.VerifierLoad(verifier_id=cluster["verifier_id"], running=1, max_batch=16, max_context_tokens=256,
                                 model="tiny", sps=[load_pb2.SpsPoint(batch_tokens=1, step_seconds=0.02)],
                                 draft_cost=[load_pb2.DraftCostPoint(requests=1, seconds=0.01)])
    temps = tensor_to_proto(torch.ones(4))
    decision = load_pb2.BudgetDecision(verify_budget=3, decided=True, calibration=load_pb2.Calibration(
        drafter_version="random-dspark-0", version=2, temperatures=temps))
    report = scheduler_pb2.StepReport(
        verifier_id=cluster["verifier_id"], step=3, batch_size=2, batch_tokens=6, step_latency_s=0.01,
        drafter_version="random-dspark-0", confidence_logits=tensor_to_proto(torch.zeros(2, 4)),
        verified_len=[2, 1], accepted_len=[1, 0])
    register = scheduler_pb2.RegisterVerifierRequest(
        address=f"127.0.0.1:{cluster['verifier'].rsplit(':', 1)[1]}", model="tiny", drafter_kind="dspark",
        drafter_version="random-dspark-0", gamma=4, load=load, sts_temperatures=temps)
    from service_helpers import internal_channel

    from dspark.proto_gen.v1 import drafter_pb2_grpc

    with internal_channel(cluster["drafter"]) as channel:
        info = drafter_pb2_grpc.DrafterStub(channel).DrafterInfo(drafter_pb2.DrafterInfoRequest(), timeout=10)
    width = len(info.target_layers) * info.hidden_size
    draft = drafter_pb2.DraftRequest(step=1, sequences=[drafter_pb2.SequenceUpdate(
        request_id="f1", tokens=[5, 6, 7], anchor_token=8, context_len=0, temperature=0.5, seed=3,
        hidden=tensor_to_proto(torch.randn(3, width).to(torch.bfloat16))),
        drafter_pb2.SequenceUpdate(request_id="f2", release=True)])
    return [
        ("scheduler", "/dspark.v1.Generation/Generate", "unary_stream", request.SerializeToString()),
        ("scheduler", "/dspark.v1.Generation/Generate", "unary_stream", chat.SerializeToString()),
        ("scheduler", "/dspark.v1.Generation/ListModels", "unary_unary", pb.ListModelsRequest().SerializeToString()),
        ("internal", "/dspark.v1.Scheduler/RegisterVerifier", "unary_unary", register.SerializeToString()),
        ("internal", "/dspark.v1.Scheduler/Heartbeat", "unary_unary",
         scheduler_pb2.HeartbeatRequest(load=load).SerializeToString()),
        ("internal", "/dspark.v1.Scheduler/ReportStep", "unary_unary", report.SerializeToString()),
        ("internal", "/dspark.v1.Scheduler/ReportSteps", "unary_unary",
         scheduler_pb2.StepReports(steps=[report, report]).SerializeToString()),
        ("verifier", "/dspark.v1.Verifier/Generate", "unary_stream",
         verifier_pb2.RoutedGenerateRequest(request=request, resume=verifier_pb2.ResumeInfo(
             streamed_token_ids=[8], streamed_text="w8")).SerializeToString()),
        ("verifier", "/dspark.v1.Verifier/GenerateMany", "stream_stream", verifier_pb2.StreamCommand(
            key=7, start=verifier_pb2.RoutedGenerateRequest(request=request),
            trace_context={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}).SerializeToString()),
        ("verifier", "/dspark.v1.Verifier/SetVerifyBudget", "unary_unary", decision.SerializeToString()),
        ("verifier", "/dspark.v1.Verifier/GetLoad", "unary_unary", verifier_pb2.GetLoadRequest().SerializeToString()),
        ("verifier", "/dspark.v1.Generation/Generate", "unary_stream", request.SerializeToString()),
        ("verifier", "/dspark.v1.Generation/ListModels", "unary_unary", pb.ListModelsRequest().SerializeToString()),
        ("drafter", "/dspark.v1.Drafter/DraftStream", "stream_stream", draft.SerializeToString()),
        ("drafter", "/dspark.v1.Drafter/DrafterInfo", "unary_unary",
         drafter_pb2.DrafterInfoRequest().SerializeToString()),
    ]


EXTREMES = {
    "int": [-1, -(2**63), 2**63 - 1, 2**31, 0, 96, 10**12],
    "uint": [0, 2**32 - 1, 2**64 - 1, 2**31, 1],
    "float": [float("nan"), float("inf"), -float("inf"), -1.0, 0.0, 1e30, -1e-30],
    "bool": [True, False],
    "string": ["", "x" * 10_000, "\u00e9\u4e2d", "unknown-model", "user"],
    "bytes": [b"", b"\x00" * 7, bytes(range(256))],
}
F = FieldDescriptor


def _extreme(field, rng: random.Random):
    if field.type in (F.TYPE_INT32, F.TYPE_INT64, F.TYPE_SINT32, F.TYPE_SINT64, F.TYPE_SFIXED32, F.TYPE_SFIXED64):
        bits = 31 if field.type in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32) else 63
        return max(-(2**bits), min(2**bits - 1, rng.choice(EXTREMES["int"])))
    if field.type in (F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_FIXED32, F.TYPE_FIXED64):
        bits = 32 if field.type in (F.TYPE_UINT32, F.TYPE_FIXED32) else 64
        return min(2**bits - 1, rng.choice(EXTREMES["uint"]))
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return rng.choice(EXTREMES["float"])
    if field.type == F.TYPE_BOOL:
        return rng.choice(EXTREMES["bool"])
    if field.type == F.TYPE_ENUM:
        return rng.choice([0, 1, 7, 99, -5])
    if field.type == F.TYPE_STRING:
        return rng.choice(EXTREMES["string"])
    return rng.choice(EXTREMES["bytes"])


def _scalar_fields(message, out: list) -> list:
    """(message, field) for every scalar or repeated-scalar field, nested messages included."""
    for field in message.DESCRIPTOR.fields:
        if field.type == F.TYPE_MESSAGE:
            if field.is_repeated:
                if field.message_type.GetOptions().map_entry:
                    continue
                for item in getattr(message, field.name):
                    _scalar_fields(item, out)
            elif message.HasField(field.name):
                _scalar_fields(getattr(message, field.name), out)
        else:
            out.append((message, field))
    return out


def mutate_fields(data: bytes, message_class, rng: random.Random) -> bytes:
    message = message_class.FromString(data)
    fields = _scalar_fields(message, [])
    for _ in range(rng.randint(1, 3)):
        if not fields:
            break
        owner, field = rng.choice(fields)
        if field.is_repeated:
            values = getattr(owner, field.name)
            if rng.random() < 0.3:
                del values[:]
            else:
                values.append(_extreme(field, rng))
        else:
            setattr(owner, field.name, _extreme(field, rng))
    return message.SerializeToString()


def mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(6)
    if not b:
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    i = rng.randrange(len(b))
    if kind == 0:
        b[i] = rng.randrange(256)
    elif kind == 1:
        del b[i:]
    elif kind == 2:
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    elif kind == 3:
        del b[i:i + rng.randint(1, 8)]
    elif kind == 4:
        j = rng.randrange(i, len(b) + 1)
        b[i:i] = b[i:j][:64]
    else:  # a huge varint (or negative int64) where a small value was
        b[i:i + 1] = b"\xff" * rng.randint(2, 9) + b"\x01"
    return bytes(b)


MESSAGE_CLASSES = {
    "/dspark.v1.Generation/Generate": pb.GenerateRequest,
    "/dspark.v1.Generation/ListModels": pb.ListModelsRequest,
    "/dspark.v1.Scheduler/RegisterVerifier": scheduler_pb2.RegisterVerifierRequest,
    "/dspark.v1.Scheduler/Heartbeat": scheduler_pb2.HeartbeatRequest,
    "/dspark.v1.Scheduler/ReportStep": scheduler_pb2.StepReport,
    "/dspark.v1.Scheduler/ReportSteps": scheduler_pb2.StepReports,
    "/dspark.v1.Verifier/Generate": verifier_pb2.RoutedGenerateRequest,
    "/dspark.v1.Verifier/GenerateMany": verifier_pb2.StreamCommand,
    "/dspark.v1.Verifier/SetVerifyBudget": load_pb2.BudgetDecision,
    "/dspark.v1.Verifier/GetLoad": verifier_pb2.GetLoadRequest,
    "/dspark.v1.Drafter/DraftStream": drafter_pb2.DraftRequest,
    "/dspark.v1.Drafter/DrafterInfo": drafter_pb2.DrafterInfoRequest,
}


def call(channel: grpc.Channel, method: str, kind: str, payload: bytes) -> grpc.StatusCode:
    metadata = (("dspark-internal-token", TOKEN),)
    try:
        if kind == "unary_unary":
            channel.unary_unary(method)(payload, timeout=15, metadata=metadata)
        elif kind == "unary_stream":
            stream = channel.unary_stream(method)(payload, timeout=15, metadata=metadata)
            next(stream, None)  # the first chunk (or the end) is the verdict; then stop it
            stream.cancel()
        else:
            stream = channel.stream_stream(method)(iter([payload]), timeout=15, metadata=metadata)
            list(stream)
        return grpc.StatusCode.OK
    except grpc.RpcError as error:
        return error.code()


def test_mutated_messages_get_documented_codes_and_servers_keep_serving(cluster):
    rng = random.Random(SEED)
    channels = {key: grpc.insecure_channel(cluster[key]) for key in ("scheduler", "internal", "verifier", "drafter")}
    codes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    bad = []
    try:
        for key, method, kind, valid in valid_messages(cluster):
            message_class = MESSAGE_CLASSES[method]
            for n in range(PER_RPC):
                payload = mutate_fields(valid, message_class, rng) if n % 2 == 0 else mutate(valid, rng)
                code = call(channels[key], method, kind, payload)
                codes[method][code.name] += 1
                if code not in DOCUMENTED:
                    bad.append((method, code.name, payload.hex()[:200]))
    finally:
        for channel in channels.values():
            channel.close()
    total = sum(sum(c.values()) for c in codes.values())
    print({m: dict(c) for m, c in codes.items()})
    assert total >= 1000
    assert not bad, bad[:5]
    for service in cluster["services"]:
        assert service.proc.poll() is None, f"{service.name} died"
        assert "Traceback" not in service.log(), f"{service.name} logged a traceback:\n{service.log()[-3000:]}"

    # Still serving: a valid request through the scheduler (mutated heartbeats may have made
    # the verifier look full or gone for a moment; its next real heartbeat corrects that).
    def serves() -> bool:
        with Client(cluster["scheduler"], timeout=30) as client:
            try:
                return len(client.generate(token_ids=[5, 6, 7], max_tokens=8).token_ids) == 8
            except Exception:
                return False

    wait_until(serves, 60, interval=1, what="a valid request served after the fuzz")
