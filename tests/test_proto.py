"""The committed generated code matches proto/, and the contract holds what method.md 6 needs."""

import filecmp
import subprocess
import sys
from pathlib import Path

import torch
from google.protobuf.descriptor import FieldDescriptor

from dspark.proto_gen.v1 import (drafter_pb2, drafter_pb2_grpc, generation_pb2, generation_pb2_grpc, load_pb2,
                                 scheduler_pb2, scheduler_pb2_grpc, tensor_pb2, verifier_pb2, verifier_pb2_grpc)
from dspark.wire import tensor_from_proto, tensor_to_proto

REPO = Path(__file__).resolve().parent.parent
COMMITTED = [REPO / "dspark" / "proto_gen", REPO / "client" / "dspark_client" / "proto_gen"]


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def test_committed_generated_code_is_up_to_date(tmp_path):
    fresh = tmp_path / "proto_gen"
    subprocess.run([sys.executable, str(REPO / "scripts" / "gen_proto.py"), "--out", str(fresh)], check=True,
                   capture_output=True)
    expected = _tree(fresh)
    assert "v1/generation_pb2_grpc.py" in expected and "v1/tensor_pb2.pyi" in expected
    for committed in COMMITTED:
        actual = _tree(committed)
        assert sorted(actual) == sorted(expected), \
            f"{committed} has other files than proto/ generates: run scripts/gen_proto.py"
        stale = [name for name in expected if actual[name] != expected[name]]
        assert not stale, f"stale generated files in {committed}: {stale}; run scripts/gen_proto.py"
    assert not filecmp.dircmp(*COMMITTED).diff_files


def test_generated_code_has_no_absolute_dspark_imports():
    # Relative imports are what lets the client carry its own copy (see scripts/gen_proto.py).
    for path in COMMITTED[0].rglob("*.py"):
        assert "from dspark." not in path.read_text(), path


def test_every_service_has_its_methods():
    expected = {
        generation_pb2: ("dspark.v1.Generation", {"Generate", "ListModels"}),
        drafter_pb2: ("dspark.v1.Drafter", {"DraftStream", "DrafterInfo"}),
        verifier_pb2: ("dspark.v1.Verifier", {"Generate", "GenerateMany", "SetVerifyBudget", "GetLoad"}),
        scheduler_pb2: ("dspark.v1.Scheduler", {"RegisterVerifier", "Heartbeat", "ReportStep", "ReportSteps"}),
    }
    for module, (full_name, methods) in expected.items():
        (service,) = module.DESCRIPTOR.services_by_name.values()
        assert service.full_name == full_name
        assert {m.name for m in service.methods} == methods
    streams = {
        m.full_name: (m.client_streaming, m.server_streaming)
        for module in expected
        for s in module.DESCRIPTOR.services_by_name.values()
        for m in s.methods
    }
    assert streams["dspark.v1.Generation.Generate"] == (False, True)
    assert streams["dspark.v1.Verifier.Generate"] == (False, True)
    assert streams["dspark.v1.Verifier.GenerateMany"] == (True, True)
    assert streams["dspark.v1.Drafter.DraftStream"] == (True, True)
    assert streams["dspark.v1.Scheduler.ReportStep"] == (False, False)
    assert streams["dspark.v1.Scheduler.ReportSteps"] == (False, False)
    for stubs in (generation_pb2_grpc, drafter_pb2_grpc, verifier_pb2_grpc, scheduler_pb2_grpc):
        assert any(name.endswith("Stub") for name in dir(stubs))


def test_no_repeated_floats_anywhere():
    """Wire rule: float arrays travel as Tensor. A float may appear only as a scalar field
    (SpsPoint.step_seconds is one value per repeated message, not a float array)."""
    float_types = {FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE}
    for module in (tensor_pb2, generation_pb2, drafter_pb2, load_pb2, verifier_pb2, scheduler_pb2):
        for message in module.DESCRIPTOR.message_types_by_name.values():
            for field in message.fields:
                assert not (field.is_repeated and field.type in float_types), f"{message.full_name}.{field.name}"


def test_prompt_is_a_oneof_and_seed_is_optional():
    request = generation_pb2.GenerateRequest(text="hi")
    request.token_ids.ids.extend([1, 2])
    assert request.WhichOneof("prompt") == "token_ids" and not request.text  # setting one clears the other
    assert not request.sampling.HasField("seed")
    request.sampling.seed = 0
    assert generation_pb2.GenerateRequest.FromString(request.SerializeToString()).sampling.HasField("seed")


def test_draft_exchange_round_trips_through_bytes():
    gamma, support, width = 4, 3, 2 * 8
    request = drafter_pb2.DraftRequest(step=7)
    update = request.sequences.add(request_id="r1", anchor_token=11, context_len=5, temperature=1.0)
    update.hidden.CopyFrom(tensor_to_proto(torch.randn(2, width).to(torch.bfloat16)))
    update.tokens.extend([9, 10])
    request.sequences.add(request_id="r0", release=True)
    decoded = drafter_pb2.DraftRequest.FromString(request.SerializeToString())
    hidden = tensor_from_proto(decoded.sequences[0].hidden, expected_dtype=torch.bfloat16, expected_shape=(None, width))
    assert hidden.shape == (2, width) and decoded.sequences[1].release

    probs = torch.softmax(torch.randn(gamma, support), dim=-1)
    draft = drafter_pb2.SequenceDraft(
        request_id="r1",
        tokens=[5, 6, 7, 8],
        confidence_logits=tensor_to_proto(torch.randn(gamma)),
        support_ids=tensor_to_proto(torch.randint(0, 100, (gamma, support))),
        support_probs=tensor_to_proto(probs),
    )
    back = drafter_pb2.DraftResponse.FromString(drafter_pb2.DraftResponse(step=7, sequences=[draft]).SerializeToString())
    got = tensor_from_proto(back.sequences[0].support_probs, expected_dtype=torch.float32, expected_shape=(gamma, support))
    assert torch.equal(got, probs)


def test_load_and_budget_messages():
    load = load_pb2.VerifierLoad(verifier_id="v0", running=3, queued=1, kv_use=0.25)
    load.sps.add(batch_tokens=16, step_seconds=0.025)
    decision = load_pb2.BudgetDecision(verify_budget=12)
    decision.calibration.version = 2
    decision.calibration.temperatures.CopyFrom(tensor_to_proto(torch.tensor([1.0, 1.2, 1.5])))
    report = scheduler_pb2.StepReport(verifier_id="v0", batch_size=2, verified_len=[3, 0], accepted_len=[1, 0])
    report.confidence_logits.CopyFrom(tensor_to_proto(torch.zeros(2, 7)))
    routed = verifier_pb2.RoutedGenerateRequest(request=generation_pb2.GenerateRequest(request_id="r", text="x"))
    routed.resume.streamed_token_ids.extend([4, 5])
    for message in (load, decision, report, routed):
        assert type(message).FromString(message.SerializeToString()) == message
