"""DSpark's sequential heads and confidence head (method.md 2).

A sequential head turns the parallel backbone into a semi-autoregressive drafter:
p_k(v) = softmax(U_k(v) + B_k(x_{k-1}, v)), x_0 = the anchor. Both heads run one slot at a time
through `step(h_k, W1[x_{k-1}], state)`, during drafting (x_{k-1} sampled) and in training
(x_{k-1} the true token). W1 is looked up once per block in training.

W1 comes in two sizes. "full": a V x r table (each lookup's backward is a dense V x r gradient).
"compact": a row per draft-vocabulary token plus the target's embedding projected to r
(CompactTokenTable): the previous token is a draft token at every slot but the first, so those
are the rows that matter, and the table shrinks from V x r to V' x r.
"""
from __future__ import annotations

import torch
from torch import nn


class CompactTokenTable(nn.Module):
    """W1[x] = P e_x + R[i(x)]: e_x the target's (frozen) embedding of x, P a d x r projection, R a
    row per draft-vocabulary token and one row shared by every other token (i(x) = V' for those)."""

    def __init__(self, hidden_size: int, rank: int, draft_vocab: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, rank, bias=False)
        self.rows = nn.Embedding(draft_vocab + 1, rank)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.rows.weight)

    def forward(self, embedded: torch.Tensor, draft_index: torch.Tensor) -> torch.Tensor:
        other = self.rows.num_embeddings - 1
        return self.proj(embedded) + self.rows(torch.where(draft_index < 0, other, draft_index))


def token_table(vocab_size: int, rank: int, draft_vocab: int, hidden_size: int, kind: str) -> nn.Module:
    if kind == "compact":
        return CompactTokenTable(hidden_size, rank, draft_vocab)
    table = nn.Embedding(vocab_size, rank)
    nn.init.normal_(table.weight, std=0.02)
    return table


class MarkovHead(nn.Module):
    """Low-rank bigram bias B_k(x_{k-1}, .) = W1[x_{k-1}] W2 (W1: V x r or compact, W2: r x V')."""

    def __init__(self, vocab_size: int, rank: int, draft_vocab: int, hidden_size: int = 0, table: str = "full"):
        super().__init__()
        self.W1 = token_table(vocab_size, rank, draft_vocab, hidden_size, table)
        self.W2 = nn.Linear(rank, draft_vocab, bias=False)
        nn.init.zeros_(self.W2.weight)  # start as plain DFlash: B = 0

    def init_state(self, rows: int, like: torch.Tensor):
        return None

    def step(self, h_k: torch.Tensor, prev_emb: torch.Tensor, state):
        return self.W2(prev_emb), state

    def teacher_forced(self, h: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        return self.W2(prev_emb)  # no state: every slot at once, one large matmul


class RNNHead(nn.Module):
    """Gated recurrent state over the block:
    z_k = [s_{k-1}; W1[x_{k-1}]; h_k], g = sigmoid(W_g z_k), s_k = g*s_{k-1} + (1-g)*tanh(W_c z_k),
    B_k = W2 tanh(W_o z_k).
    """

    def __init__(self, vocab_size: int, rank: int, draft_vocab: int, hidden_size: int, table: str = "full"):
        super().__init__()
        self.rank = rank
        self.W1 = token_table(vocab_size, rank, draft_vocab, hidden_size, table)
        z = 2 * rank + hidden_size
        self.W_c, self.W_g, self.W_o = nn.Linear(z, rank), nn.Linear(z, rank), nn.Linear(z, rank)
        self.W2 = nn.Linear(rank, draft_vocab, bias=False)
        nn.init.zeros_(self.W2.weight)

    def init_state(self, rows: int, like: torch.Tensor):
        return like.new_zeros(rows, self.rank)

    def step(self, h_k: torch.Tensor, prev_emb: torch.Tensor, state: torch.Tensor):
        z = torch.cat([state, prev_emb, h_k], dim=-1)
        g = torch.sigmoid(self.W_g(z))
        new_state = g * state + (1 - g) * torch.tanh(self.W_c(z))
        return self.W2(torch.tanh(self.W_o(z))), new_state

    def teacher_forced(self, h: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        state, biases = self.init_state(h.shape[0], h), []
        for k in range(h.shape[1]):
            bias, state = self.step(h[:, k], prev_emb[:, k], state)
            biases.append(bias)
        return torch.stack(biases, 1)


class ScoreLinear(nn.Linear):
    """A one-output projection. Not an nn.Linear to `apply_precision` (its type check is exact), so
    it stays fp32 under every precision: a quantized kernel for one output column buys nothing."""


class ConfidenceHead(nn.Module):
    """Raw logit z_k with c_k = sigmoid(z_k) = sigmoid(w . [h_k; W1[x_{k-1}]] + b)."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.proj = ScoreLinear(hidden_size + rank, 1)

    def forward(self, h_k: torch.Tensor, prev_embedding: torch.Tensor | None) -> torch.Tensor:
        x = h_k if prev_embedding is None else torch.cat([h_k, prev_embedding], dim=-1)
        return self.proj(x).squeeze(-1)

    def split(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafting: the w_h . h_k + b part of every slot at once ([..., g]) and the weights of the
        W1 part ([r]), so a slot adds one dot product: z_k = part[..., k] + W1[x_{k-1}] . w_p."""
        w, d = self.proj.weight[0], self.hidden_size
        return h @ w[:d] + self.proj.bias[0], w[d:]


def run_teacher_forced(head, confidence: ConfidenceHead | None, h: torch.Tensor, prev_emb: torch.Tensor | None):
    """All slots of [A, g] blocks given W1 of the true previous tokens [A, g, r] (None without a head):
    (bias [A, g, V'] or None, conf [A, g] or None)."""
    bias = head.teacher_forced(h, prev_emb) if head is not None else None
    conf = confidence(h, prev_emb) if confidence is not None else None
    return bias, conf
