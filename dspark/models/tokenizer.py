"""Tokenizer + chat template, from a Hugging Face directory or from GGUF metadata."""
from __future__ import annotations

import json
from pathlib import Path

import jinja2
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, tok: HFTokenizer, chat_template: str | None, bos_token: str | None = None,
                 eos_token: str | None = None, add_bos: bool = False):
        self.tok = tok
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.add_bos = bos_token, eos_token, add_bos
        self._template = (jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(chat_template)
                          if chat_template else None)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token is not None:
            ids = [self.tok.token_to_id(self.bos_token)] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            # No template: plain concatenation keeps base models usable.
            return "\n".join(m["content"] for m in messages) + "\n"
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        text = self.apply_chat_template(messages)
        return self.tok.encode(text, add_special_tokens=False).ids

    @staticmethod
    def from_hf_dir(path: str | Path) -> Tokenizer:
        path = Path(path)
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg = {}
        if (path / "tokenizer_config.json").exists():
            cfg = json.loads((path / "tokenizer_config.json").read_text())

        def _name(t):
            return t.get("content") if isinstance(t, dict) else t

        return Tokenizer(tok, cfg.get("chat_template"), _name(cfg.get("bos_token")), _name(cfg.get("eos_token")),
                         add_bos=bool(cfg.get("add_bos_token", False)))

    @staticmethod
    def from_gguf_fields(fields: dict) -> Tokenizer:
        """Byte-level BPE from tokenizer.ggml.* metadata (gpt2-style models such as SmolLM2)."""
        if fields["tokenizer.ggml.model"] != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer {fields['tokenizer.ggml.model']!r}")
        tokens = fields["tokenizer.ggml.tokens"]
        types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
        # llama.cpp's "smollm"/"starcoder" pre-tokenizer: single digits, then the GPT-2 split.
        pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if fields.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "codeshell"):
            pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
        tok.decoder = decoders.ByteLevel()
        control = [tokens[i] for i, t in enumerate(types) if t == 3]  # 3 = control token
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        bos = fields.get("tokenizer.ggml.bos_token_id")
        eos = fields.get("tokenizer.ggml.eos_token_id")
        return Tokenizer(tok, fields.get("tokenizer.chat_template"),
                         tokens[bos] if bos is not None else None, tokens[eos] if eos is not None else None,
                         add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)))
