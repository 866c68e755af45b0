"""DSpark: the parallel backbone plus a sequential head and a confidence head (method.md 2).

p_k = softmax(U_k + B_k(x_{k-1}, .)) with the Markov (default) or RNN head;
c_k = sigmoid(w . [h_k; W1[x_{k-1}]] + b) estimates that x_k survives verification.
"""
from __future__ import annotations

from dspark.drafters.dflash import ParallelDrafter
from dspark.drafters.heads import ConfidenceHead, MarkovHead, RNNHead


class DSparkDrafter(ParallelDrafter):
    def __init__(self, cfg, embed_weight, lm_head_weight, draft_vocab=None):
        super().__init__(cfg, embed_weight, lm_head_weight, draft_vocab)
        cfg = self.cfg
        if cfg.head == "markov":
            self.head = MarkovHead(cfg.vocab_size, cfg.markov_rank, cfg.draft_vocab, cfg.hidden_size, cfg.markov_table)
        elif cfg.head == "rnn":
            self.head = RNNHead(cfg.vocab_size, cfg.markov_rank, cfg.draft_vocab, cfg.hidden_size, cfg.markov_table)
        if cfg.confidence:
            self.confidence_head = ConfidenceHead(cfg.hidden_size, cfg.markov_rank if self.head is not None else 0)
