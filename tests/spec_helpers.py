"""Test drafters and tiny targets for the speculative loop."""
from __future__ import annotations

import torch

from dspark.drafters import DraftBlock, DrafterConfig, build_drafter
from dspark.engine.generate import Engine
from dspark.models.config import ModelConfig
from dspark.models.transformer import Transformer
from dspark.sampling import SamplingParams


def tiny_target(vocab: int = 64, seed: int = 0, layers: int = 4, sharpness: float = 8.0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=layers,
                      num_heads=4, num_kv_heads=2, head_dim=8, eos_token_ids=())
    model = Transformer(cfg).eval()
    with torch.no_grad():  # sharper logits than the default init, so sampling is not near-uniform
        model.lm_head.weight.mul_(sharpness)
    return model


def random_drafter(target: Transformer, kind: str, gamma: int = 4, seed: int = 1, **kw):
    torch.manual_seed(seed)
    ctx_layers = [0, 1] if target.config.num_layers <= 2 else [1, 2]
    cfg = DrafterConfig.for_target(target.config, kind, ctx_layers=ctx_layers, gamma=gamma, num_layers=1,
                                   markov_rank=16, **kw)
    return build_drafter(cfg, target.model.embed_tokens.weight, target.lm_head.weight).eval()


class OracleDrafter:
    """Drafts exactly the target's own greedy continuation (known in advance): every draft is accepted."""

    kind, version, has_confidence, remote, drafts_ahead = "oracle", "test", False, False, False

    def __init__(self, gamma: int, ctx_layers: list[int], reference: dict[str, list[int]]):
        self.gamma, self.ctx_layers, self.reference = gamma, ctx_layers, reference
        self.ctx: dict[str, int] = {}

    def context_len(self, req_id):
        return self.ctx.get(req_id, 0)

    def rollback(self, req_id, n):
        self.ctx[req_id] = n

    def extend_context(self, req_id, features, tokens):
        self.ctx[req_id] = self.ctx.get(req_id, 0) + len(tokens)

    def release(self, req_id):
        self.ctx.pop(req_id, None)

    def push(self):
        pass

    def free_draft(self, req_ids, texts, device=None):
        return None

    def draft(self, req_ids, anchors, temperatures, generators, gaps=None):
        rows = []
        for i, r in enumerate(req_ids):
            full = self.reference[r]
            a = self.ctx[r] + (gaps[i] if gaps else 0)  # anchor position; drafts are positions a+1..a+gamma
            nxt = full[a + 1:a + 1 + self.gamma]
            rows.append(nxt + [0] * (self.gamma - len(nxt)))
        tokens = torch.tensor(rows)
        return DraftBlock(tokens=tokens, conf_logits=None, support_ids=tokens[..., None],
                          support_probs=torch.ones(tokens.shape + (1,)))


def greedy_reference(target, prompts, max_tokens, max_len=256):
    engine = Engine(target, max_batch=len(prompts), max_len=max_len)
    return [s.output for s in engine.generate(prompts, SamplingParams(max_tokens=max_tokens))]


def with_gguf_blocks(module: torch.nn.Module, qtype: int = 3) -> torch.nn.Module:
    """Every nn.Linear of `module` stored as a GGUF file would store it (ggml type 3 = Q4_1, 8 =
    Q8_0), its fp32 weight replaced by what the blocks hold: a model the gguf precision can run,
    equal to its fp32 self, as a GGUF checkpoint's is. In place; returns the module."""
    import gguf
    import numpy as np

    from dspark.models.precision import GgufBlocks

    for linear in [m for m in module.modules() if type(m) is torch.nn.Linear]:
        weight = linear.weight.detach().float().numpy()
        blocks = gguf.quants.quantize(weight, gguf.GGMLQuantizationType(qtype))
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(np.array(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype)),
                                                          dtype=np.float32)).reshape(linear.weight.shape))
        linear.gguf_blocks = GgufBlocks(qtype, torch.from_numpy(np.ascontiguousarray(blocks)).reshape(
            linear.out_features, -1))
    return module
