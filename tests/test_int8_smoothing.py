"""int8 with SmoothQuant's scales (dspark/models/int8_smoothing.py): the product kept, outlier inputs no
longer costing the other inputs their bits, the ranges measured once per model, the text not the eval sets'."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dspark.models import int8_smoothing
from dspark.models.batch import VarlenBatch
from dspark.models.int8_smoothing import CALIBRATION, cached_input_ranges, linear_input_ranges, smoothing_scale
from dspark.models.loader import load_model
from dspark.models.precision import Int8Linear
from dspark.train.corpus.eval_overlap import eval_grams, overlaps
from tests.service_helpers import write_tiny_target
from tests.spec_helpers import tiny_target

KERNELS = ["vnni", "fbgemm"]  # int8_matmul.cpp where the CPU has VNNI (else FBGEMM again), FBGEMM


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float((y - reference).norm() / reference.norm())


@pytest.mark.parametrize("kernel", KERNELS)
def test_smoothing_keeps_the_product_and_spares_the_other_inputs_an_outliers_range(kernel, monkeypatch):
    monkeypatch.setenv("DSPARK_INT8_KERNEL", kernel)
    torch.manual_seed(0)
    linear = nn.Linear(96, 64)
    x = torch.randn(40, 96)
    x[:, [3, 40]] *= 60  # two inputs far larger than the rest on every row, as in LLM activations
    reference = linear(x).detach()
    s = smoothing_scale(x.abs().amax(0), linear.weight)
    torch.testing.assert_close((x / s) @ (linear.weight * s).T + linear.bias, reference, rtol=1e-4, atol=1e-4)
    plain, smoothed = Int8Linear(linear), Int8Linear(linear, x.abs().amax(0))
    assert plain.x_scale is None and smoothed.x_scale is not None
    assert relative_error(smoothed(x), reference) < 0.5 * relative_error(plain(x), reference)


def with_outlier_channels(target):
    """Norm weights that make a few inputs of every q|k|v and gate|up projection 40x the others."""
    with torch.no_grad():
        for layer in target.model.layers:
            layer.input_layernorm.weight[[0, 7]] *= 40
            layer.post_attention_layernorm.weight[[5]] *= 40
    return target


def logits(model, tokens: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(tokens))
    with torch.no_grad():
        return model(VarlenBatch.build([tokens], [0], [cache.allocate()]), cache, logits_rows="all").logits


def test_a_smoothed_int8_model_is_closer_to_fp32_on_text_it_was_not_calibrated_on():
    calibration = [[5, 9, 11, 3, 7, 2, 30, 4, 1, 17], [60, 2, 2, 8, 33, 41]]
    text = [12, 50, 7, 7, 21, 3, 44, 18, 9, 26, 61, 0]
    reference = logits(with_outlier_channels(tiny_target(layers=3)), text)
    plain = with_outlier_channels(tiny_target(layers=3))
    plain.set_precision("int8")
    smoothed = with_outlier_channels(tiny_target(layers=3))
    smoothed.set_precision("int8", linear_input_ranges(smoothed, calibration))
    assert relative_error(logits(smoothed, text), reference) < 0.7 * relative_error(logits(plain, text), reference)


def test_ranges_are_measured_once_per_model_file_and_kept_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    measured = []

    def measure(model, sequences):
        measured.append(len(sequences))
        return linear_input_ranges(model, sequences)

    monkeypatch.setattr(int8_smoothing, "linear_input_ranges", measure)
    model_file = tmp_path / "model.gguf"
    model_file.write_bytes(b"one")
    target, sequences = tiny_target(layers=2), [[5, 9, 11, 3], [7, 2]]
    first = cached_input_ranges(target, sequences, model_file)
    again = cached_input_ranges(target, sequences, model_file)
    assert measured == [2] and list(tmp_path.joinpath("cache").glob("model-int8-ranges-*.safetensors"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert "lm_head" in first and "model.layers.1.self_attn.qkv_proj" in first  # the fused linears that run
    cached_input_ranges(target, sequences[:1], model_file)  # other text: measured again
    model_file.write_bytes(b"another")  # another model in the same place: measured again
    cached_input_ranges(target, sequences, model_file)
    assert measured == [2, 1, 2]


def test_load_model_puts_every_int8_linear_on_smoothquant_scales(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    path = write_tiny_target(tmp_path / "tiny")
    smoothed = load_model(str(path), precision="int8").model
    linears = [m for m in smoothed.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 4 * 4 + 1 and all(m.x_scale is not None for m in linears)
    plain = load_model(str(path), precision="int8", int8_smoothing=False).model
    assert all(m.x_scale is None for m in plain.modules() if isinstance(m, Int8Linear))
    monkeypatch.setenv("DSPARK_INT8_SMOOTHING", "0")  # the services' switch, for measuring what the scales change
    plain = load_model(str(path), precision="int8").model
    assert all(m.x_scale is None for m in plain.modules() if isinstance(m, Int8Linear))


def test_the_calibration_text_shares_no_13_gram_with_the_eval_sets():
    turns = json.loads(CALIBRATION.read_text())["turns"]
    index = eval_grams()
    assert len(turns) >= 10
    for turn in turns:
        assert not overlaps(turn["user"], index) and not overlaps(turn["assistant"], index), turn["id"]
