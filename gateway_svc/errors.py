"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with an HTTP status."""
from __future__ import annotations

import grpc


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# What an upstream gRPC status means for an HTTP client.
_FROM_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "context_length_exceeded"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (413, "invalid_request_error", "request_too_large"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
    grpc.StatusCode.CANCELLED: (499, "server_error", "cancelled"),
}


def from_upstream(code: grpc.StatusCode | None, message: str) -> ApiError:
    status, kind, short = _FROM_GRPC.get(code, (500, "server_error", None))
    return ApiError(status, message, type=kind, code=short)
