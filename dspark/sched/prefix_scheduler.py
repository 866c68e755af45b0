"""Hardware-aware prefix scheduler: the math under the two-step rule (docs/method.md).

For requests r with prefix survival a[r, j] (j = 0..gamma-1 is draft token j+1), verifying
lengths l_r puts B = sum_r (1 + l_r) tokens through the target and yields
tau = sum_r (1 + sum_{j < l_r} a[r, j]) expected tokens. Throughput is Theta = tau * SPS(B).

`sps` is any callable B -> steps per second (an `SpsTable`, or a plain function in tests);
`budget_from_survival` calls it once with an int array of every B it considers.

Losslessness rule behind every function here: whether draft token x_k is verified may depend
on x_1..x_{k-1} (through a_k) and on other requests, never on x_k itself. Since a_k only
depends on tokens before k and a falls along j, ranking by a with ties broken by lower j keeps
every token behind its own prefix; the functions below rely on that and check it.
"""

from __future__ import annotations

import itertools

import numpy as np


def prefix_survival(conf: np.ndarray) -> np.ndarray:
    """a[r, k] = prod_{i <= k} conf[r, i]: probability that draft tokens 1..k all survive."""
    return np.cumprod(np.asarray(conf, dtype=np.float64), axis=-1)


def _check_survival(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"prefix survival must be [R, gamma], got shape {a.shape}")
    if np.any(np.diff(a, axis=1) > 0):
        # A rising a would let a token outrank its own prefix: the ranking would no longer be causal.
        raise ValueError("prefix survival must not rise along the block (use prefix_survival(conf))")
    return a


def _rank_order(a: np.ndarray, eligible: np.ndarray | None = None):
    """(r, j) pairs sorted by a descending; ties: lower j first, then lower r."""
    rows, cols = np.nonzero(np.ones_like(a, dtype=bool) if eligible is None else eligible)
    order = np.lexsort((rows, cols, -a[rows, cols]))  # last key is the primary one
    return rows[order], cols[order]


def _theta(lengths: np.ndarray, a: np.ndarray, sps) -> float:
    tokens = int(np.sum(1 + lengths))
    tau = sum(1.0 + a[r, :n].sum() for r, n in enumerate(lengths))
    return tau * sps(tokens)


def causal_greedy(a: np.ndarray, sps) -> np.ndarray:
    """Algorithm 1: add draft tokens best-first while Theta rises; stop at the first drop.

    Returns lengths [R]. The early stop is what keeps it lossless: the decision to add a token
    only looks at tokens ranked before it (and at its own a, which its own value cannot change).
    """
    a = _check_survival(a)
    num_requests = a.shape[0]
    lengths = np.zeros(num_requests, dtype=np.int64)
    tokens = num_requests  # every request sends its anchor
    tau = float(num_requests)  # and gets at least one token back
    theta = tau * sps(tokens)
    for r, j in zip(*_rank_order(a)):
        new_theta = (tau + a[r, j]) * sps(tokens + 1)
        if not new_theta > theta:
            break
        assert lengths[r] == j, "ranking broke prefix order"
        lengths[r] += 1
        tokens += 1
        tau += a[r, j]
        theta = new_theta
    return lengths


def lookahead_search(a: np.ndarray, sps) -> np.ndarray:
    """Best Theta over every length vector (exhaustive, (gamma+1)^R cases).

    NOT LOSSLESS: looking past a drop lets a_{k+1}, which depends on x_k, decide whether x_k
    is verified (method.md 5, paper Appendix A). Kept only to demonstrate that bias in tests.
    Ties go to the first vector in itertools.product order (request 0 shortest first).
    """
    a = _check_survival(a)
    num_requests, gamma = a.shape
    best, best_theta = None, -np.inf
    for lengths in itertools.product(range(gamma + 1), repeat=num_requests):
        theta = _theta(np.array(lengths), a, sps)
        if theta > best_theta:
            best, best_theta = np.array(lengths, dtype=np.int64), theta
    return best


def budget_from_survival(a_two_steps_ago: np.ndarray, sps, draft_seconds: float = 0.0,
                         drafted_scale: float = 1.0, min_gain: float = 1.0, base_tokens: int = 0,
                         requests: int = 0) -> int:
    """Two-step rule: a step's verify budget K from the survivals of two steps ago.

    Global search over every K = 0..R*gamma on the real (jagged) SPS table, no early stop:
    with K draft tokens the best tau is R + (sum of the K largest survivals), which is prefix
    closed because a falls along j. Theta(K) = (R + best_extra(K)) / step_seconds(K). Returns
    the arg max (smallest K on ties). Lossless because K never sees the drafts it will admit.

    draft_seconds: what drafting adds to a step for these R requests. K = 0 means "do not
    draft at all", so only K > 0 pays it: Theta(0) = R * SPS(R) is plain decoding, and a
    drafter that costs more than it saves loses to it.

    drafted_scale: how much longer drafted steps really take than the tables say (measured live
    by the caller; 1 = the tables are right). min_gain: from two requests on, a budget K > 0 must
    promise at least this many times plain decoding's Theta (1 = any gain). The margin covers what
    the per-step model cannot see, that requests of a batch finish at different steps and the
    slowest decides the wall time; one request's steps are its wall time, so it drafts on any gain.

    base_tokens: draft tokens the step verifies anyway, besides these (a drafted step's drafter
    tokens, when the rows here are lookup's): they cost what they cost whatever K is.

    requests: the requests of the step, when more than the rows here: the others have no draft of
    the drafter's (prompt lookup guessed for them), yet every one of them is in the pass and gets its
    token. At 16 requests with one row left to the drafter, that row alone once read as one request's
    step (7 ms, where the batch's took 17) and bought a draft of every row for two verified tokens.
    """
    a = _check_survival(a_two_steps_ago)
    num_requests = max(a.shape[0], int(requests))
    best_extra = np.concatenate([[0.0], np.cumsum(np.sort(a.ravel())[::-1])])
    token_counts = num_requests + max(int(base_tokens), 0) + np.arange(best_extra.size)
    rates = np.broadcast_to(np.asarray(sps(token_counts), dtype=np.float64), token_counts.shape)
    drafted = np.arange(best_extra.size) > 0
    step_seconds = np.where(drafted, (1.0 / rates + max(float(draft_seconds), 0.0)) * drafted_scale, 1.0 / rates)
    theta = (num_requests + best_extra) / step_seconds
    if num_requests > 1:
        theta[0] *= max(float(min_gain), 1.0)
    return int(np.argmax(theta))  # argmax returns the first (smallest K) maximum


def admit_top_k(a_current: np.ndarray, budget: int, caps: np.ndarray | None = None) -> np.ndarray:
    """Verification lengths [R]: the `budget` best draft tokens by current survival.

    Ties are broken by position (lower j first, then lower r), so a token never comes before
    its own prefix. caps[r] limits request r to its first caps[r] drafts (0 = no speculation).
    """
    a = _check_survival(a_current)
    num_requests, gamma = a.shape
    if caps is None:
        caps = np.full(num_requests, gamma)
    caps = np.clip(np.asarray(caps, dtype=np.int64), 0, gamma)
    eligible = np.arange(gamma)[None, :] < caps[:, None]
    rows, _ = _rank_order(a, eligible)
    chosen_rows = rows[: max(int(budget), 0)]
    # The chosen set is prefix closed, so counting per request gives the lengths.
    return np.bincount(chosen_rows, minlength=num_requests).astype(np.int64)
