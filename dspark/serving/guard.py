"""What every call passes before a servicer sees it: decoding that cannot crash, and, on an
internal port, the caller's credentials.

- A message that does not decode (corrupt bytes, invalid UTF-8 in a string) is INVALID_ARGUMENT
  with one log line; gRPC's own path would log a traceback and answer UNKNOWN.
- Internal ports (Scheduler, Verifier, Drafter): each configured mechanism must pass. Token:
  metadata `dspark-internal-token` equals one of DSPARK_INTERNAL_TOKEN (UNAUTHENTICATED
  otherwise). Mutual TLS with DSPARK_TLS_SERVER_NAME set: the client certificate must carry that
  name, i.e. be the services' own certificate, not a public client's (PERMISSION_DENIED).
  Health and reflection stay open (probes).
- An exception a servicer did not expect is INTERNAL with the traceback logged, never UNKNOWN.
"""
from __future__ import annotations

import contextlib
import hmac
import logging

import grpc

from dspark.serving.token_metadata import TOKEN_KEY

log = logging.getLogger(__name__)
OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


class Undecodable:
    """Stands in for a request message that did not decode."""

    def __init__(self, error: str):
        self.error = error


def safe_deserializer(deserialize):
    if deserialize is None:
        return None

    def decode(data: bytes):
        try:
            return deserialize(data)
        except Exception as error:  # DecodeError, UnicodeDecodeError, ...
            return Undecodable(f"{type(error).__name__}: {error}"[:200])
    return decode


def peer_cert_names(context) -> set[str]:
    auth = context.auth_context() or {}
    names = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        names.update(v.decode(errors="replace") for v in auth.get(key, ()))
    return names


def caller_identity(context) -> str:
    """Who called, as far as the transport can say: the certificate's name under mutual TLS,
    else "token" (every token holder is alike) or "anonymous"."""
    names = sorted(peer_cert_names(context))
    if names:
        return "cert:" + names[0]
    return "token" if _sent_token(context) else "anonymous"


def _sent_token(context) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == TOKEN_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


class ServerGuard(grpc.aio.ServerInterceptor):
    def __init__(self, internal: bool, tokens: list[str], cert_name: str = ""):
        self.internal, self.tokens, self.cert_name = internal, list(tokens), cert_name

    async def _refuse(self, method: str, context) -> None:
        """Aborts the call unless its caller is one of ours (internal ports only)."""
        if not self.internal:
            return
        if self.tokens:
            sent = _sent_token(context)
            if not any(hmac.compare_digest(sent.encode(), t.encode()) for t in self.tokens):
                log.warning("refused %s from %s: %s", method, context.peer(),
                            "no internal token" if not sent else "wrong internal token")
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this is an internal service: valid "
                                    f"{TOKEN_KEY} metadata required")
        if self.cert_name and self.cert_name not in peer_cert_names(context):
            auth = context.auth_context() or {}
            if auth.get("transport_security_type") == [b"ssl"]:
                log.warning("refused %s from %s: certificate is not the services' (%s)", method, context.peer(),
                            self.cert_name)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"internal service: only the services' certificate ({self.cert_name}) may call")

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler  # probes; their servicers write with context.write, not generators
        return wrap_handler(handler, details.method, self._refuse)


async def _undecodable(method: str, request, context) -> None:
    if isinstance(request, Undecodable):
        log.warning("%s from %s: undecodable message (%s)", method, context.peer(), request.error)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable message: {request.error}")


@contextlib.asynccontextmanager
async def _internal_errors(method: str, context):
    """A bug in a handler becomes INTERNAL with one log line; gRPC's own errors and aborts pass."""
    try:
        yield
    except (grpc.aio.AbortError, grpc.RpcError):
        raise
    except Exception as error:
        log.exception("%s failed unexpectedly", method)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(error).__name__}")


def wrap_handler(handler, method: str, refuse):
    decode = safe_deserializer(handler.request_deserializer)

    def checked(request_iterator, context):
        async def each():
            async for request in request_iterator:
                await _undecodable(method, request, context)
                yield request
        return each()

    async def admit(request, context):
        await refuse(method, context)
        await _undecodable(method, request, context)

    if handler.unary_unary is not None:
        async def unary_unary(request, context):
            await admit(request, context)
            async with _internal_errors(method, context):
                return await handler.unary_unary(request, context)
        return grpc.unary_unary_rpc_method_handler(unary_unary, decode, handler.response_serializer)

    if handler.unary_stream is not None:
        async def unary_stream(request, context):
            await admit(request, context)
            async with _internal_errors(method, context):
                async for response in handler.unary_stream(request, context):
                    yield response
        return grpc.unary_stream_rpc_method_handler(unary_stream, decode, handler.response_serializer)

    if handler.stream_unary is not None:
        async def stream_unary(request_iterator, context):
            await refuse(method, context)
            async with _internal_errors(method, context):
                return await handler.stream_unary(checked(request_iterator, context), context)
        return grpc.stream_unary_rpc_method_handler(stream_unary, decode, handler.response_serializer)

    async def stream_stream(request_iterator, context):
        await refuse(method, context)
        async with _internal_errors(method, context):
            async for response in handler.stream_stream(checked(request_iterator, context), context):
                yield response
    return grpc.stream_stream_rpc_method_handler(stream_stream, decode, handler.response_serializer)
