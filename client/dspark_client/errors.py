"""Errors the SDK raises: gRPC status codes turned into exceptions with a readable message."""

import grpc


class DSparkError(Exception):
    """A generation call failed. `code` is the gRPC status; `tokens_received` how far it got."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, tokens_received: int = 0):
        super().__init__(message)
        self.code = code
        self.tokens_received = tokens_received


class DeadlineExceeded(DSparkError):
    pass


class Unavailable(DSparkError):
    pass


def from_rpc_error(error: grpc.RpcError, address: str, timeout: float | None, tokens_received: int) -> DSparkError:
    # Both the sync call object and grpc.aio.AioRpcError expose code() and details().
    code, details = error.code(), error.details()
    got = f"{tokens_received} tokens received"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        limit = f"{timeout:g} s" if timeout is not None else "the deadline"
        return DeadlineExceeded(f"deadline exceeded: no complete answer from {address} within {limit} ({got})", code,
                                tokens_received)
    if code == grpc.StatusCode.UNAVAILABLE:
        if tokens_received:
            why = f"stream broke after {got}; not retried because tokens had already been delivered"
        else:
            why = "no token received"
        return Unavailable(f"server at {address} unavailable: {details} ({why})", code, tokens_received)
    return DSparkError(f"{code.name} from {address}: {details} ({got})", code, tokens_received)
