"""Per-request context cache: one row per decided position, rollback = a shorter length.

Rows can be anything with the position as dim 0 (projected keys/values, fused features, token
ids). Storage grows by doubling so appending a few positions per step costs no full copy.
"""
from __future__ import annotations

import torch


class ContextCache:
    def __init__(self):
        self._store: dict[str, torch.Tensor] = {}
        self._len: dict[str, int] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._store

    def __len__(self) -> int:
        """How many requests hold a context."""
        return len(self._store)

    def length(self, req_id: str) -> int:
        return self._len.get(req_id, 0)

    def append(self, req_id: str, rows: torch.Tensor) -> None:
        n = self.length(req_id)
        store = self._store.get(req_id)
        if store is None or n + rows.shape[0] > store.shape[0]:
            capacity = max(16, 2 * (n + rows.shape[0]))
            grown = rows.new_empty((capacity, *rows.shape[1:]))
            if store is not None:
                grown[:n] = store[:n]
            store = self._store[req_id] = grown
        store[n:n + rows.shape[0]] = rows
        self._len[req_id] = n + rows.shape[0]

    def truncate(self, req_id: str, n: int) -> None:
        if n < 0 or n > self.length(req_id):
            raise ValueError(f"cannot keep {n} of {self.length(req_id)} context positions of {req_id!r}")
        if req_id in self._len:
            self._len[req_id] = n

    def rows(self, req_id: str) -> torch.Tensor:
        return self._store[req_id][:self.length(req_id)]

    def padded(self, req_ids: list[str], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of several requests right-padded to the longest: ([R, L, ...], valid [R, L] bool).

        `like` gives the row shape and dtype for requests that have no rows yet.
        """
        lengths = [self.length(r) for r in req_ids]
        if len(req_ids) == 1 and lengths[0]:  # one request: a view, no copy
            return self.rows(req_ids[0])[None], torch.ones(1, lengths[0], dtype=torch.bool, device=like.device)
        longest = max(lengths, default=0)
        out = like.new_zeros((len(req_ids), longest, *like.shape[1:]))
        for i, (req, n) in enumerate(zip(req_ids, lengths)):
            if n:
                out[i, :n] = self._store[req][:n]
        valid = torch.arange(longest, device=like.device)[None, :] < torch.tensor(lengths, device=like.device)[:, None]
        return out, valid

    def release(self, req_id: str) -> None:
        self._store.pop(req_id, None)
        self._len.pop(req_id, None)
