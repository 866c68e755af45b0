"""The real default target from its GGUF, checked against transformers reading the same file."""
from __future__ import annotations

import pytest
import torch

from dspark.engine.generate import Engine
from dspark.models.loader import default_gguf_path
from dspark.sampling import SamplingParams

PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
           "Give me two tips for sleeping better."]


@pytest.fixture(scope="module")
def hf_gguf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok


@pytest.mark.slow
def test_tokenizer_matches_transformers(smollm2, hf_gguf):
    _, hf_tok = hf_gguf
    texts = ["Hello world! 12345 apples", "  def f(x):\n\treturn x**2  # square", "<|im_start|>user\nhi<|im_end|>",
             "Ünïcödé — emojis 🙂 and tabs\t\t."]
    for text in texts:
        assert smollm2.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False)
        assert smollm2.tokenizer.decode(smollm2.tokenizer.encode(text), skip_special_tokens=False) == text


@pytest.mark.slow
def test_greedy_continuation_matches_transformers(smollm2, hf_gguf):
    hf, _ = hf_gguf
    engine = Engine(smollm2.model, max_batch=4, max_len=512, eos_ids=())  # no early stop: 32 tokens each
    prompts = [smollm2.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    ours = engine.generate(prompts, SamplingParams(max_tokens=32))  # all three batched together
    for prompt, seq in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert seq.output == ref
