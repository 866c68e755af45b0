"""The caller's side of the internal token: every call on a channel to a peer service carries it.

Channel interceptors, so no call site has to remember it (drafter link, scheduler reports,
routing to verifiers). No token configured = nothing added.
"""
from __future__ import annotations

import collections

import grpc

TOKEN_KEY = "dspark-internal-token"


def _with_metadata(metadata, token: str) -> list[tuple[str, str]]:
    return [*(metadata or ()), (TOKEN_KEY, token)]


class _AioToken:
    def __init__(self, token: str):
        self.token = token

    def _details(self, details):
        return details._replace(metadata=_with_metadata(details.metadata, self.token))


# grpc.aio files an interceptor under the first of the four kinds it is, so one class per kind.
class _AioUnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _AioStreamStream(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def aio_interceptors(tokens: list[str]) -> list:
    if not tokens:
        return []
    return [kind(tokens[0]) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


class _CallDetails(collections.namedtuple("_CallDetails", "method timeout metadata credentials wait_for_ready compression"),
                   grpc.ClientCallDetails):
    pass


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self.token = token

    def _details(self, d):
        return _CallDetails(d.method, d.timeout, _with_metadata(d.metadata, self.token), d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def with_token(channel: grpc.Channel, tokens: list[str]) -> grpc.Channel:
    """The channel itself when there is no token (closing the intercepted one closes it too)."""
    return grpc.intercept_channel(channel, _SyncToken(tokens[0])) if tokens else channel
