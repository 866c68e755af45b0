"""--device: every tensor of a step on the model's device, checked by a TorchFunctionMode; the
device flag's errors; the services refusing a GPU they have not got.

DSPARK_TEST_DEVICE (default cpu) picks the device the engine tests run on: scripts/gpu_check.sh
runs this file with cuda, where the checker's mixed-device rule bites as well.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark.device import DeviceUnavailable, host_values, resolve_device
from dspark.engine.generate import Engine
from dspark.models.batch import VarlenBatch
from dspark.models.precision import CudaBf16Linear, resolve_precision
from dspark.sampling import SamplingParams
from dspark.speculative.engine import SpecEngine
from dspark.speculative.policy import FixedDraftLen
from tests.device_checker import DeviceChecker, DeviceViolation
from tests.spec_helpers import random_drafter, tiny_target

ROOT = Path(__file__).resolve().parents[1]
DEVICE = resolve_device(os.environ.get("DSPARK_TEST_DEVICE", "cpu"))
MISSING_GPU = f"cuda:{torch.cuda.device_count()}"  # one past the last visible GPU: never there
KINDS = ["dspark", "dflash", "eagle3"]


def prompts_of(lengths, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


# ---- the flag ----------------------------------------------------------------------------------
def test_resolve_device_names_and_errors():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    for bad in ("tpu", "cuda:x", "", "meta"):
        with pytest.raises(ValueError, match="--device must be cpu, cuda or cuda:N"):
            resolve_device(bad)
    with pytest.raises(DeviceUnavailable, match=f"--device {MISSING_GPU}"):
        resolve_device(MISSING_GPU)
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailable, match="run with --device cpu or on a GPU node"):
            resolve_device("cuda")


def test_precision_choice_follows_the_device():
    assert resolve_precision("auto", "cuda") == "bf16"
    assert resolve_precision("fp32", "cuda:1") == "fp32"
    with pytest.raises(ValueError, match="int8 runs on CPU kernels"):
        resolve_precision("int8", "cuda")
    assert resolve_precision("int8", "cpu") == "int8"


def test_cuda_bf16_linear_is_a_bf16_matmul_with_fp32_io():
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 8)
    x = torch.randn(3, 16)
    y = CudaBf16Linear(linear)(x)
    want = torch.nn.functional.linear(x.bfloat16(), linear.weight.bfloat16(), linear.bias.bfloat16()).float()
    assert y.dtype == torch.float32 and torch.equal(y, want)


@pytest.mark.parametrize("module, who, flags", [
    ("verifier_svc", "verifier", ["--port=0"]), ("drafter_svc", "drafter", ["--port=0"]),
    ("dspark.generate", "generate", ["hello"]), ("dspark.local", "local", []),
])
def test_commands_refuse_a_gpu_they_have_not_got(module, who, flags):
    proc = subprocess.run([sys.executable, "-m", module, f"--device={MISSING_GPU}", *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith(f"{who}: --device {MISSING_GPU}: ")
    assert "listening" not in proc.stderr and "starting services" not in proc.stderr  # before ports or weights


# ---- the checker itself ------------------------------------------------------------------------
def test_checker_catches_stray_tensors():
    device = torch.device("cpu")
    with pytest.raises(DeviceViolation, match="torch.zeros without device="), DeviceChecker(device):
        torch.zeros(3)
    with pytest.raises(DeviceViolation, match="torch.arange\\(device=meta\\)"), DeviceChecker(device):
        torch.arange(4, device="meta")
    elsewhere = torch.ones(2, device="meta")  # made outside the step
    with pytest.raises(DeviceViolation, match="mixes tensors on \\['cpu', 'meta'\\]"), DeviceChecker(device):
        torch.ones(2, device=device) + elsewhere
    # A violation the code under test swallows still fails the check on exit.
    with pytest.raises(DeviceViolation, match="torch.tensor without device="), DeviceChecker(device):
        try:
            torch.tensor([1, 2])
        except DeviceViolation:
            pass


def test_checker_allows_what_the_design_allows():
    with DeviceChecker("cpu") as checker:
        torch.zeros(3, device="cpu")
        host_values([1, 2, 3], torch.long, torch.device("cpu"))
        torch.rand(2, generator=torch.Generator().manual_seed(1))  # a request's CPU generator
        torch.ones(2, device="cpu") * torch.tensor(2.0, device="cpu")
        torch.as_tensor(torch.ones(1, device="cpu"))
    assert checker.factory_calls == 6 and not checker.violations  # as_tensor of a tensor creates nothing


def test_checker_catches_a_stray_tensor_planted_in_a_real_step(monkeypatch):
    target = tiny_target().to(DEVICE)
    engine = Engine(target, max_batch=2, max_len=64)
    engine.add(prompts_of([5])[0], SamplingParams(max_tokens=3))
    # The bug this file guards against: one index tensor built without the model's device.
    monkeypatch.setattr(VarlenBatch, "last_rows", lambda self: torch.tensor([sum(self.lens) - 1]))
    with pytest.raises(DeviceViolation, match="torch.tensor without device="), DeviceChecker(DEVICE):
        engine.step()


# ---- the engines and drafters on an explicit device ---------------------------------------------
def _run(engine, prompts, params):
    seqs = [engine.add(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_work():
        engine.step()
    return seqs


def outputs(seqs):
    return [s.output for s in seqs]


PARAMS = [SamplingParams(max_tokens=12), SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=10),
          SamplingParams(max_tokens=15)]


@pytest.mark.parametrize("kind", KINDS)
def test_spec_engine_and_drafter_stay_on_the_device(kind):
    target = tiny_target().to(DEVICE)
    drafter = random_drafter(target, kind).to(DEVICE)
    prompts = prompts_of([6, 13, 4])
    unchecked = _run(SpecEngine(target, drafter, FixedDraftLen(3), max_batch=4, max_len=128), prompts, PARAMS)
    with DeviceChecker(DEVICE) as checker:
        checked = _run(SpecEngine(target, drafter, FixedDraftLen(3), max_batch=4, max_len=128), prompts, PARAMS)
    assert checker.factory_calls > 50  # it really looked at the step's creations
    assert sum(s.spec.metrics.draft_tokens for s in checked) > 0  # drafting and verification really ran
    assert outputs(checked) == outputs(unchecked)  # the checker observes, it changes nothing
    plain = _run(Engine(target, max_batch=4, max_len=128), prompts, PARAMS)
    # Greedy through speculation = plain decoding on this device; the seeded sampled request
    # (index 1) replays the same under the checker, which the line above asserts.
    assert outputs(checked)[0::2] == outputs(plain)[0::2]


def test_plain_engine_with_captured_states_stays_on_the_device():
    target = tiny_target().to(DEVICE)
    engine = Engine(target, max_batch=4, max_len=128, capture_layers=(1, 2))
    with DeviceChecker(DEVICE):
        seqs = engine.generate(prompts_of([5, 9]), [SamplingParams(max_tokens=6), SamplingParams(max_tokens=4)])
    features, hidden, lse = seqs[0].captured[-1]
    assert features.device.type == hidden.device.type == lse.device.type == DEVICE.type


def test_real_target_and_shipped_drafter_stay_on_the_device():
    from dspark.drafters.shipped import load_drafter_for
    from dspark.models.loader import load_model

    loaded = load_model(device=DEVICE, precision="fp32")
    drafter = load_drafter_for(loaded, "dspark")
    assert loaded.model.device.type == DEVICE.type
    assert {p.device.type for p in drafter.parameters()} | {b.device.type for b in drafter.buffers()} == {DEVICE.type}
    prompt = loaded.tokenizer.encode_chat([{"role": "user", "content": "Name three colours."}])
    engine = SpecEngine(loaded.model, drafter, FixedDraftLen(drafter.gamma), max_batch=2, max_len=256)
    with DeviceChecker(DEVICE):
        seq = engine.add(prompt, SamplingParams(max_tokens=8))
        while engine.has_work():
            engine.step()
    assert seq.spec.metrics.draft_tokens > 0  # the drafter and the verification really ran
    assert seq.output == _run(Engine(loaded.model, max_batch=2, max_len=256), [prompt],
                              [SamplingParams(max_tokens=8)])[0].output


@pytest.mark.parametrize("kind", KINDS)
def test_training_step_stays_on_the_device(kind):
    from dspark.train.config import TrainConfig
    from dspark.train.dataset import Sequence, target_features
    from dspark.train.trainer import TargetLSE, sequence_loss, sequence_to

    target = tiny_target().to(DEVICE)
    drafter = random_drafter(target, kind).to(DEVICE).train()
    tokens = torch.tensor(prompts_of([40], seed=3)[0])
    features, hidden = target_features(target, tokens, drafter.ctx_layers)
    raw = Sequence(tokens, torch.arange(40) >= 6, features.cpu(), hidden.cpu())  # as a dataset hands it over
    lse = TargetLSE(drafter.lm_head_full)
    with DeviceChecker(DEVICE) as checker:
        seq = sequence_to(raw, DEVICE)
        result = sequence_loss(drafter, seq, lambda positions: lse(0, raw, positions), TrainConfig(), 256,
                               torch.Generator().manual_seed(0))
        result["loss"].backward()
    assert checker.factory_calls > 0 and torch.isfinite(result["loss"])
    assert all(p.grad is not None and p.grad.device.type == DEVICE.type
               for p in drafter.parameters() if p.requires_grad and p.grad is not None)
    assert any(p.grad is not None for p in drafter.parameters())


def test_confidence_scheduled_engine_stays_on_the_device():
    from dspark.sched.budget_source import TwoStepBudget
    from dspark.speculative.policy import ConfidencePolicy

    target = tiny_target().to(DEVICE)
    drafter = random_drafter(target, "dspark").to(DEVICE)
    source = TwoStepBudget(sps=lambda tokens: 100.0, default_draft_len=2)
    policy = ConfidencePolicy(source, explore=0.5)
    engine = SpecEngine(target, drafter, policy, max_batch=4, max_len=128)
    with DeviceChecker(DEVICE):
        seqs = _run(engine, prompts_of([6, 13, 4]), PARAMS)
    assert source.history  # the confidences went through the policy's host-side maths
    assert outputs(seqs)[0::2] == outputs(_run(Engine(target, max_batch=4, max_len=128), prompts_of([6, 13, 4]),
                                               PARAMS))[0::2]
