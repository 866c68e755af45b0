"""The parallel block drafter (DFlash), which DSpark extends with its heads.

H_ctx = RMSNorm(W_c [H^(l1); ...; H^(lm)]). The block [x_a, MASK, ..., MASK] at positions
a..a+gamma-1 runs through N BlockDecoderLayers (context < a plus the whole block), a final
norm and the target's LM head: row k-1 gives the base logits U_k of slot k (token at a+k).
DFlash drafts every slot from U_k alone.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark.drafters.base import DraftBlock, Drafter
from dspark.drafters.block_layer import BlockDecoderLayer
from dspark.drafters.context_kv import ContextKV
from dspark.drafters.heads import CompactTokenTable, MarkovHead, run_teacher_forced
from dspark.kernels.cpu import kernels
from dspark.models.layers import RMSNorm, Rotary, apply_rotary, fuse_linears
from dspark.models.transformer import layer_stack


class ParallelDrafter(Drafter):
    def __init__(self, cfg, embed_weight, lm_head_weight, draft_vocab=None):
        super().__init__(cfg, embed_weight, lm_head_weight, draft_vocab)
        cfg, d = self.cfg, self.cfg.hidden_size
        self.ctx_proj = nn.Linear(cfg.num_ctx_layers * d, d, bias=False)  # W_c
        self.ctx_norm = RMSNorm(d, cfg.rms_eps)
        self.mask_embedding = nn.Parameter(torch.randn(d) * 0.02)  # the MASK token (the target has none)
        self.layers = nn.ModuleList(BlockDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, None, 4096)
        self.head = None  # sequential head (DSpark)
        self.confidence_head = None
        self.contexts = ContextKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)

    # ---- the backbone, shared by training and drafting ----
    def context_states(self, features: torch.Tensor) -> torch.Tensor:
        return self.ctx_norm(self.ctx_proj(features.float()))

    def context_kv(self, features: torch.Tensor, first_pos: int):
        """Per layer (k, v) [L, KV, hd] of context rows at positions first_pos.."""
        h_ctx = self.context_states(features)
        n = h_ctx.shape[0]
        cos, sin = self.rotary.cos_sin(first_pos + torch.arange(n, device=h_ctx.device), first_pos + n)
        if not hasattr(self, "context_kv_proj"):
            return [layer.context_kv(h_ctx, cos, sin) for layer in self.layers]
        layers, kv_heads, hd = len(self.layers), self.cfg.num_kv_heads, self.cfg.head_dim
        kv = self.context_kv_proj(h_ctx).view(n, layers, 2, kv_heads, hd)
        k = apply_rotary(kv[:, :, 0].reshape(n, layers * kv_heads, hd), cos, sin).view(n, layers, kv_heads, hd)
        return [(k[:, i], kv[:, i, 1]) for i in range(layers)]

    def fuse_projections(self) -> None:
        """Serving: every layer's k|v of context rows in one matmul (they all read H_ctx), one rotation
        for all of them; then each layer's own fusions. The checkpoint keeps the separate layout."""
        if hasattr(self, "context_kv_proj"):
            return
        for layer in self.layers:
            layer.fuse_projections()
        self.context_kv_proj = fuse_linears(*(layer.kv_proj for layer in self.layers))

    def block_inputs(self, anchors: torch.Tensor) -> torch.Tensor:
        """[x_a, MASK, ..., MASK] embeddings: [A] -> [A, gamma, d]."""
        x = self.mask_embedding.expand(anchors.shape[0], self.gamma, -1).clone()
        x[:, 0] = self.embed(anchors)
        return x

    def run_blocks(self, anchors, block_start, ctx_kv, ctx_visible) -> torch.Tensor:
        """anchors/block_start [G, n]; ctx_kv per layer ([G, KV, L, hd], same); ctx_visible [G, n, L].

        Returns the final-normed hidden states [G, n, gamma, d]; row k-1 is slot k.
        """
        G, n = anchors.shape
        x = self.block_inputs(anchors.reshape(-1)).view(G, n, self.gamma, -1)
        positions = block_start[..., None] + torch.arange(self.gamma, device=anchors.device)
        cos, sin = self.rotary.cos_sin(positions.reshape(-1))
        cos, sin = cos.view(G, n, self.gamma, -1), sin.view(G, n, self.gamma, -1)
        for layer, (k_ctx, v_ctx) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k_ctx, v_ctx, ctx_visible)
        return self.norm(x)

    def prev_embedding(self, prev: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}] of the sequential head, for target ids of any shape."""
        table = self.head.W1
        if isinstance(table, CompactTokenTable):
            return table(self.embed(prev), self.to_draft_index(prev))
        return table(prev)

    def slot_outputs(self, hidden: torch.Tensor, prev: torch.Tensor):
        """Teacher-forced slot logits [A, g, V'] (U_k, plus B_k with a head) and confidence logits or None."""
        logits = self.draft_logits(hidden)
        prev_emb = self.prev_embedding(prev) if self.head is not None else None  # [A, g, r], one lookup
        bias, conf = run_teacher_forced(self.head, self.confidence_head, hidden, prev_emb)
        return (logits if bias is None else logits + bias), conf

    # ---- training ----
    def train_forward(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor):
        """Many blocks of one sequence in one pass (teacher forcing).

        features [L, m*d], tokens [L], anchors [A] (each < L). Block b sees context positions
        < anchors[b] and its own block. Returns (logits [A, g, V'], conf_logits [A, g] or None).
        """
        L = tokens.shape[0]
        kv = [(k.transpose(0, 1)[None], v.transpose(0, 1)[None]) for k, v in self.context_kv(features, 0)]
        ctx_visible = (torch.arange(L, device=tokens.device)[None, :] < anchors[:, None])[None]
        hidden = self.run_blocks(tokens[anchors][None], anchors[None], kv, ctx_visible)[0]
        # x_{k-1} for slot k: the anchor, then the true tokens (clamped at the end; those slots are invalid).
        prev_pos = (anchors[:, None] + torch.arange(self.gamma, device=tokens.device)).clamp(max=L - 1)
        return self.slot_outputs(hidden, tokens[prev_pos])

    # ---- inference ----
    @property
    def drafts_ahead(self) -> bool:
        return True

    @torch.no_grad()
    def extend_context(self, req_id: str, features: torch.Tensor, tokens: torch.Tensor) -> None:
        if features.shape[0] != tokens.shape[0]:
            raise ValueError(f"{features.shape[0]} feature rows for {tokens.shape[0]} tokens")
        if features.shape[0] == 0:
            return
        features = features.to(self.lm_head_draft.device)
        if self._on_cpu_kernels() and hasattr(self, "context_kv_proj"):
            # Every layer's keys rotated and written with the values by one kernel call (context_kv's math).
            kv = self.context_kv_proj(self.context_states(features))
            slot, start = self.contexts.claim(req_id, kv.shape[0])
            positions = torch.arange(start, start + kv.shape[0], device=kv.device)
            cos, signed_sin = self.rotary.rope_rows(positions, start + kv.shape[0])
            kernels().rope_cache_write(kv, cos, signed_sin, self.contexts.k, self.contexts.v,
                                       torch.full_like(positions, slot), positions)
            return
        self.contexts.append(req_id, self.context_kv(features, self.context_len(req_id)))

    @torch.no_grad()
    def draft(self, req_ids, anchors, temperatures, generators, forced_tokens=None, return_logits=False,
              gaps=None):
        """gaps [R] (draft-ahead): positions between a request's context and its anchor whose features
        it does not have yet; the anchor then sits at context_len + gap. The block attends to the
        context it has."""
        device = self.lm_head_draft.device
        anchors = anchors.long().to(device)
        lengths = [self.context_len(r) for r in req_ids]
        starts = lengths if gaps is None else [n + int(gap) for n, gap in zip(lengths, gaps)]
        if self._on_cpu_kernels():
            hidden = self._run_blocks_in_cache(req_ids, anchors, lengths, starts)
        else:
            kv, valid = self.contexts.gather(req_ids)
            starts = torch.tensor(starts, device=device)
            hidden = self.run_blocks(anchors[:, None], starts[:, None], kv, valid[:, None])[:, 0]
        return self.sample_block(hidden, anchors, temperatures, generators, forced_tokens, return_logits)

    def _on_cpu_kernels(self) -> bool:
        return (self.lm_head_draft.device.type == "cpu" and kernels() is not None
                and all(hasattr(layer, "qkv_proj") and hasattr(layer.mlp, "gate_up_proj") for layer in self.layers))

    def _run_blocks_in_cache(self, req_ids, anchors, lengths: list[int], starts: list[int]) -> torch.Tensor:
        """run_blocks for drafting on the CPU kernels: each layer as the target's fused layer runs, the
        block's keys and values written into its request's slot right after the context (scratch the
        next context rows overwrite) and every row attending to the context and the whole block.
        Rotations at the block's true positions `starts` (past the context after a draft-ahead gap).
        Returns the final-normed hidden states [R, gamma, d]."""
        R, g = anchors.shape[0], self.gamma
        slots = [self.contexts.slot(r) for r in req_ids]
        self.contexts.reserve(max(lengths) + g)
        x = self.block_inputs(anchors).reshape(R * g, -1)
        device = anchors.device  # the CPU: these kernels are CPU ones
        # Per row: slot, write position, keys seen, rotation position.
        rows = torch.tensor([[slot, n + j, n + g, s + j] for slot, n, s in zip(slots, lengths, starts) for j in range(g)],
                            device=device).T.contiguous()
        cos, signed_sin = self.rotary.rope_rows(rows[3], max(starts) + g)
        stack = self._layer_stack()
        if stack is not None:  # the loop below in one call
            delta, _ = stack.forward(x, cos, signed_sin, self.contexts.k, self.contexts.v, rows[0], rows[1], [], rows[2])
        else:
            delta, rope, where = None, (cos[:, None], signed_sin[:, None]), (rows[0], rows[1], rows[2])
            for i, layer in enumerate(self.layers):
                delta = layer.cached_forward(x, delta, rope, self.contexts.k[i], self.contexts.v[i], where)
        return kernels().add_rms_norm(x, delta, self.norm.weight, self.norm.eps, False).view(R, g, -1)

    def _layer_stack(self):
        """The layers as one kernels().LayerStack (the target's: cached_forward's kernels in its order, so
        the same bits; a draft's glue between its 16 kernel calls cost more than some of them), made
        at the first draft on the CPU kernels; None where the kernels are not int8 or gguf-q8."""
        if "_stack" not in self.__dict__:
            self.__dict__["_stack"] = layer_stack(self.layers)
        return self.__dict__["_stack"]

    def use_precision(self, precision: str) -> None:
        super().use_precision(precision)
        self.__dict__.pop("_stack", None)  # the layers' matmuls change: made again at the next draft

    def sample_block(self, hidden, anchors, temperatures, generators, forced_tokens, return_logits) -> DraftBlock:
        """Left to right: x_k ~ q_k from U_k (+ B_k(x_{k-1})), x_0 = the anchor."""
        base = self.draft_logits(hidden)
        if (forced_tokens is None and not return_logits and bool((temperatures <= 0).all())
                and (self.head is None or isinstance(self.head, MarkovHead))):
            return self._greedy_block(hidden, base, anchors)
        state = self.head.init_state(hidden.shape[0], hidden) if self.head is not None else None
        # Sampled slots follow a draft token; forced ones (scoring) may not, and take W2 itself.
        biases = self._draft_token_biases() if forced_tokens is None else None
        prev = anchors
        tokens, confs, ids, probs, all_logits = [], [], [], [], []
        for k in range(self.gamma):
            logits, prev_emb = base[:, k], None
            if self.head is not None:
                prev_emb = self.prev_embedding(prev)
                if k and biases is not None:
                    bias = biases[self.to_draft_index(prev)]
                else:
                    bias, state = self.head.step(hidden[:, k], prev_emb, state)
                logits = logits + bias
            if self.confidence_head is not None:
                confs.append(self.confidence_head(hidden[:, k], prev_emb))
            forced = forced_tokens[:, k] if forced_tokens is not None else None
            prev, slot_ids, slot_probs = self.sample_slot(logits, temperatures, generators, forced)
            tokens.append(prev), ids.append(slot_ids), probs.append(slot_probs), all_logits.append(logits)
        return DraftBlock(
            tokens=torch.stack(tokens, 1),
            conf_logits=torch.stack(confs, 1).float() if confs else None,
            support_ids=torch.stack(ids, 1), support_probs=torch.stack(probs, 1).float(),
            logits=torch.stack(all_logits, 1).float() if return_logits else None)

    def _greedy_block(self, hidden, base, anchors) -> DraftBlock:
        """sample_block when every request is greedy and the head keeps no state (the common serving
        case), in a few ops a slot instead of ~100: x_k = argmax(U_k + W2 W1[x_{k-1}]); W1 of a draft
        token comes from a table built once (every slot after the first follows a draft token), and
        the confidence's h_k part is computed for all slots at once. Same tokens and support. On the
        CPU kernels with a bias table, everything after the LM head and W2 of the anchor is one call
        (markov_greedy_block): after a target pass each torch op here cost several times its warm cost."""
        R = hidden.shape[0]
        rows = self._draft_token_rows() if self.head is not None else None
        prev_emb = None
        if rows is not None:  # W1 of the anchors: rows of the table when all are draft tokens (most are)
            index = self.to_draft_index(anchors)
            prev_emb = rows[index] if bool((index >= 0).all()) else self.prev_embedding(anchors)
        biases = self._draft_token_biases()
        support = min(self.cfg.support_size, base.shape[-1])
        if biases is not None and kernels() is not None:  # the chain and all that follows it in one call
            scored = self.confidence_head
            tokens, confs, support_ids, support_probs = kernels().markov_greedy_block(
                base, self.head.W2(prev_emb), biases, self.draft_vocab, support,
                *((hidden, prev_emb, rows, scored.proj.weight[0], float(scored.proj.bias[0])) if scored else ()))
            return DraftBlock(tokens=tokens, conf_logits=confs, support_ids=support_ids, support_probs=support_probs)
        conf_h, w_prev = self.confidence_head.split(hidden) if self.confidence_head is not None else (None, None)
        if self.head is None:
            picks = base.argmax(-1)
        else:
            picks = []
            for k in range(self.gamma):  # the chain itself: a row lookup, an add and an argmax a slot
                if k and biases is not None:
                    logits = base[:, k] + biases[picks[-1]]
                else:
                    logits = base[:, k] + self.head.W2(prev_emb if k == 0 else rows[picks[-1]])
                picks.append(logits.argmax(-1))
            picks = torch.stack(picks, 1)
        confs = None
        if conf_h is not None:  # every slot's W1[x_{k-1}] part at once, once the chain is known
            confs = conf_h if prev_emb is None else \
                conf_h + torch.cat([prev_emb[:, None], rows[picks[:, :-1]]], dim=1) @ w_prev
        tokens = self.draft_vocab[picks]
        # The general loop's greedy support: the token with probability 1, padded with draft id 0.
        support_ids = self.draft_vocab[0].expand(R, self.gamma, support).clone()
        support_ids[..., 0] = tokens
        support_probs = torch.zeros(R, self.gamma, support, device=hidden.device)
        support_probs[..., 0] = 1.0
        return DraftBlock(tokens=tokens, conf_logits=confs.float() if confs is not None else None,
                          support_ids=support_ids, support_probs=support_probs)

    def _draft_token_biases(self) -> torch.Tensor | None:
        """The Markov head's bias after every draft-vocabulary token, W2 W1[x] [V', V'] in bf16, on a CPU
        (None elsewhere, or with another head). Every slot but the first follows a draft token, and
        there a 1-row matmul streams all of W2 (4 MB in bf16) for one row, where the table gives it in
        16 KB: on one thread 7 such matmuls were 1.8 ms of a 10 ms block. 128 MB at V' = 8,192. Rebuilt
        when W1's or W2's weights change."""
        if not isinstance(self.head, MarkovHead) or self.lm_head_draft.device.type != "cpu":
            return None
        key = tuple((p.data_ptr(), p._version) for p in self.head.parameters())
        cached = self.__dict__.get("_token_biases")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_token_biases"] = (key, self.head.W2(self._draft_token_rows()).bfloat16())
        return cached[1]

    def _draft_token_rows(self) -> torch.Tensor:
        """W1 of every draft-vocabulary token [V', r], rebuilt when W1's weights change (training
        updates them in place, which bumps their version)."""
        key = tuple((p.data_ptr(), p._version) for p in self.head.W1.parameters())
        cached = self.__dict__.get("_token_rows")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_token_rows"] = (key, self.prev_embedding(self.draft_vocab))
        return cached[1]


DFlashDrafter = ParallelDrafter
