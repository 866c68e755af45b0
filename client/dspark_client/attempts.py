"""One Generate call's attempts, the same for the sync and the async client: which replica comes
next, the request it gets (resuming after what the caller already has), and whether a failure is
retried (retry.py decides) or goes to the caller as a ClientError."""

from .errors import from_rpc_error
from .request import Received
from .retry import Deadline, retry_delay
from .tracing import current_trace_metadata
from .types import Chunk


class Attempts:
    def __init__(self, client, request, timeout: float | None, metadata):
        self.client, self.request, self.metadata = client, request, tuple(metadata)
        self.deadline = Deadline(timeout if timeout is not None else client.timeout)
        self.received = Received()
        self.attempt = 0

    def start(self):
        """The next attempt's call: the next replica after a failure."""
        self.attempt += 1
        stubs = self.client.replicas.stubs
        # The caller's current span (if any) parents the servers' spans; metadata passed by hand
        # comes last, so its traceparent wins.
        metadata = current_trace_metadata() + self.client.metadata + self.metadata
        return stubs[(self.attempt - 1) % len(stubs)].Generate(
            self.received.resume(self.request), timeout=self.deadline.remaining(), metadata=metadata)

    def take(self, message) -> Chunk:
        self.received.add(message)
        return Chunk.from_proto(message)

    def delay_after(self, error) -> float:
        """Seconds to wait before the next attempt; raises the caller's error when there is none."""
        tokens = len(self.received.token_ids)
        delay = retry_delay(self.client.retry, error.code(), self.attempt, tokens, self.deadline,
                            resumable=len(self.client.replicas.stubs) > 1)
        if delay is None:
            raise from_rpc_error(error, self.client.address, self.deadline.timeout, tokens) from error
        return delay
