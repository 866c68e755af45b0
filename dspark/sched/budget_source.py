"""Where a confidence policy's verify budget comes from (see verify_budget.py for the rule).

  TwoStepBudget    in process: from the policy's own confidences of two drafted steps ago
  ScheduledBudget  under the scheduler service: the budget it pushes with its replies, computed
                   off the critical path from what this verifier reported earlier

Both answer `budget(R)` (for the admission this step) and `next_budget(R)` (for the decision to
draft at all, from the newest confidences that are at least a step old), and fall back to
default_draft_len per request while they know nothing better. Pure bookkeeping: no threads,
no I/O; `ScheduledBudget.push` is a single assignment, safe from another thread.
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np

from dspark.sched.prefix_scheduler import budget_from_survival


class TwoStepBudget:
    def __init__(self, sps, default_draft_len: int, draft_cost=None):
        """sps: callable B -> steps/s of a step without drafting; draft_cost: callable R -> seconds
        drafting adds for R requests (None: free)."""
        self.sps, self.default_draft_len, self.draft_cost = sps, default_draft_len, draft_cost
        self.history: deque[np.ndarray] = deque(maxlen=2)  # prefix survivals of the last drafted steps
        self.from_scheduler = False

    def _from(self, survival: np.ndarray, num_requests: int) -> int:
        """survival: the drafter's rows (lookup's are not its); the step holds num_requests."""
        draft_seconds = float(self.draft_cost(survival.shape[0])) if self.draft_cost is not None else 0.0
        return budget_from_survival(survival, self.sps, draft_seconds, requests=num_requests)

    def budget(self, num_requests: int) -> int:
        if self.history:  # two drafts old once there are two (one draft old before that)
            return self._from(self.history[0], num_requests)
        return self.default_draft_len * num_requests

    def next_budget(self, num_requests: int) -> int:
        if self.history:
            return self._from(self.history[-1], num_requests)
        return self.default_draft_len * num_requests

    def tick(self) -> None:
        pass

    def observe(self, survival: np.ndarray) -> None:
        self.history.append(survival)  # used two drafted steps from now


class ScheduledBudget:
    """The scheduler's budget while it is fresh. Once the scheduler has been silent for more than
    `ttl_steps` steps *and* `ttl_s` seconds (both, so neither a fast engine nor an idle one drops a
    good budget early), default_draft_len per request until it speaks again."""

    def __init__(self, default_draft_len: int, ttl_steps: int = 100, ttl_s: float = 5.0, clock=time.monotonic):
        self.default_draft_len, self.ttl_steps, self.ttl_s, self.clock = default_draft_len, ttl_steps, ttl_s, clock
        self.steps = 0  # steps so far (engine thread)
        self._pushed: tuple[int, int, float] | None = None  # (budget, at step, at time), replaced whole
        self.from_scheduler = False  # whether the last answer was the scheduler's

    def push(self, budget: int | None) -> None:
        self._pushed = None if budget is None else (int(budget), self.steps, self.clock())

    def scheduled(self) -> int | None:
        """The scheduler's last budget while it is still in force, else None."""
        pushed = self._pushed
        if pushed is None:
            return None
        budget, at_step, at_time = pushed
        if self.steps - at_step > self.ttl_steps and self.clock() - at_time > self.ttl_s:
            return None
        return budget

    def budget(self, num_requests: int) -> int:
        budget = self.scheduled()
        self.from_scheduler = budget is not None
        return budget if budget is not None else self.default_draft_len * num_requests

    def next_budget(self, num_requests: int) -> int:
        return self.budget(num_requests)  # the scheduler's budget is already the newest knowledge

    def tick(self) -> None:
        self.steps += 1

    def observe(self, survival: np.ndarray) -> None:
        pass  # the scheduler sees the confidences through the verifier's step reports
