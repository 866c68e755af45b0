"""When a failed Generate call may be retried, and how long to wait.

Only UNAVAILABLE (server down, restarting, connection refused). Once a token has reached the
caller, only a client with several server replicas retries (`resumable`): it sends the tokens
and text it has (GenerateRequest.resume), so the other replica continues after them and the
caller sees no token twice and none missing. A single-address client does not, as before.
"""

import time
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3         # total attempts; 1 = never retry
    initial_backoff: float = 0.1  # seconds before the 2nd attempt
    multiplier: float = 2.0
    max_backoff: float = 2.0

    def backoff(self, failed_attempt: int) -> float:
        return min(self.max_backoff, self.initial_backoff * self.multiplier ** (failed_attempt - 1))


DEFAULT_RETRY = RetryPolicy()  # frozen: one shared default is safe


class Deadline:
    """One deadline for the whole call, retries included."""

    def __init__(self, timeout: float | None):
        self.timeout = timeout
        self._end = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self._end is None else max(0.0, self._end - time.monotonic())


def retry_delay(
    policy: RetryPolicy, code: grpc.StatusCode, failed_attempt: int, tokens_received: int, deadline: Deadline,
    resumable: bool = False,
) -> float | None:
    """Seconds to wait before retrying, or None when the error must go to the caller."""
    if code != grpc.StatusCode.UNAVAILABLE or failed_attempt >= policy.max_attempts:
        return None
    if tokens_received and not resumable:
        return None
    delay = policy.backoff(failed_attempt)
    left = deadline.remaining()
    if left is not None and left <= delay:
        return None
    return delay
