"""The HTTP server (Starlette): routes, limits, SSE. Translation lives in the plain modules beside it."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from dspark_client import AsyncClient, DSparkError
from opentelemetry import propagate
from opentelemetry.trace import INVALID_SPAN, SpanKind, Status, StatusCode
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dspark.serving import tracing

from . import openai_response as out
from .auth import check_authorization
from .errors import ApiError, from_upstream
from .openai_request import Plan, parse_chat, parse_completion
from .upstream import merged_chunks
from .usage import ChoiceTotals, usage

log = logging.getLogger("gateway_svc")


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int = 1 << 20  # larger bodies get 413 before they are parsed
    max_concurrent: int = 256         # upstream generations in flight; more get 429
    max_n: int = 16                   # choices per request (n x prompts)


class Gateway:
    """State shared by the routes: the SDK client, the keys, the limits and what is in flight."""

    def __init__(self, connect: Callable[[], AsyncClient], api_keys: list[str], limits: Limits):
        self.connect, self.api_keys, self.limits = connect, api_keys, limits
        self.client: AsyncClient | None = None  # opened in the server's event loop (grpc.aio binds to it)
        self.in_flight = 0  # upstream generations running (the event loop is the only writer)
        self._default_model = ""

    async def default_model(self) -> str:
        if not self._default_model:
            try:
                models = await self.client.list_models(timeout=10)
            except DSparkError as error:
                raise from_upstream(error.code, str(error)) from error
            self._default_model = models[0].name if models else "default"
        return self._default_model

    def reserve(self, count: int) -> None:
        if self.in_flight + count > self.limits.max_concurrent:
            raise ApiError(429, f"too many concurrent generations (limit {self.limits.max_concurrent}); retry later",
                           type="rate_limit_error", code="rate_limit_exceeded")
        self.in_flight += count

    def release(self, count: int) -> None:
        self.in_flight -= count


def create_app(gateway: Gateway) -> Starlette:
    async def health(request: Request) -> Response:
        """Ready when the scheduler answers and routes to at least one verifier."""
        try:
            models = await gateway.client.list_models(timeout=2)
        except DSparkError as error:
            return JSONResponse({"status": "unavailable", "detail": str(error)}, status_code=503)
        except Exception as error:  # noqa: BLE001  (an unreachable scheduler is "not ready", not a crash)
            return JSONResponse({"status": "unavailable", "detail": str(error)}, status_code=503)
        status = 200 if models else 503
        return JSONResponse({"status": "ok" if models else "no model served yet", "in_flight": gateway.in_flight},
                            status_code=status)

    async def live(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        check_authorization(request.headers.get("authorization"), gateway.api_keys)
        try:
            listed = await gateway.client.list_models(timeout=10)
        except DSparkError as error:
            raise from_upstream(error.code, str(error)) from error
        return JSONResponse(out.model_list(listed, int(time.time())))

    async def chat(request: Request) -> Response:
        return await generate(request, parse_chat)

    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion)

    async def generate(request: Request, parse) -> Response:
        check_authorization(request.headers.get("authorization"), gateway.api_keys)
        plan: Plan = parse(await read_json(request, gateway.limits.max_request_bytes), gateway.limits.max_n)
        model = plan.model or await gateway.default_model()
        gateway.reserve(len(plan.choices))
        span = start_span(request, plan)
        try:
            if plan.stream:
                return await stream(gateway, plan, model, span)  # the response releases and ends the span
            body = await whole(request, gateway, plan, model, span)
        except BaseException as error:
            finish(gateway, plan, span, error)
            raise
        finish(gateway, plan, span, None)
        return JSONResponse(body)

    async def api_error(request: Request, error: ApiError) -> Response:
        return JSONResponse(error.body(), status_code=error.status)

    async def unexpected(request: Request, error: Exception) -> Response:
        log.exception("unexpected error on %s", request.url.path)
        return JSONResponse(ApiError(500, f"internal error: {type(error).__name__}", type="server_error").body(),
                            status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        gateway.client = gateway.connect()
        try:
            yield
        finally:
            await gateway.client.close()

    routes = [Route("/health", health), Route("/health/live", live), Route("/v1/models", models),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={ApiError: api_error, Exception: unexpected}, lifespan=lifespan)


async def read_json(request: Request, limit: int) -> object:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > limit:  # a chunked body has no Content-Length to check up front
                raise too_large(limit)
    except ClientDisconnect:
        raise ApiError(400, "the client went away while sending the request") from None
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body over the limit of {limit} bytes", code="request_too_large")


# ---- non-streamed ----------------------------------------------------------------------------------
async def whole(request: Request, gateway: Gateway, plan: Plan, model: str, span) -> dict:
    task = asyncio.create_task(collect(gateway, plan, model, span))
    gone = asyncio.create_task(wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():  # the client went away: cancelling the task cancels the gRPC calls
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ApiError(499, "the client closed the connection", type="server_error", code="cancelled")
    return task.result()


async def collect(gateway: Gateway, plan: Plan, model: str, span) -> dict:
    totals = [ChoiceTotals(c.prompt_index) for c in plan.choices]
    texts: list[list[str]] = [[] for _ in plan.choices]
    finishes: list[str | None] = [None] * len(plan.choices)
    async with contextlib.aclosing(merged_chunks(gateway.client, plan.choices, tracing.metadata(span))) as chunks:
        async for index, chunk in chunks:
            totals[index].add(chunk)
            texts[index].append(chunk.text)
            finishes[index] = out.finish_reason(chunk.finish_reason) or finishes[index]
    return out.response(plan.kind, out.new_id(plan.kind), int(time.time()), model,
                        [("".join(t), f) for t, f in zip(texts, finishes)], usage(totals))


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- streamed (SSE) --------------------------------------------------------------------------------
class CleanupStreamingResponse(StreamingResponse):
    """Runs `cleanup` however the stream ends, even when the client left before the first byte."""

    def __init__(self, content, cleanup, **kwargs):
        super().__init__(content, **kwargs)
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.cleanup()


async def stream(gateway: Gateway, plan: Plan, model: str, span) -> Response:
    chunks = merged_chunks(gateway.client, plan.choices, tracing.metadata(span))
    try:
        first = await anext(chunks)  # an upstream error before any token is still an HTTP status
    except BaseException:
        await chunks.aclose()
        raise
    id, created = out.new_id(plan.kind), int(time.time())
    totals = [ChoiceTotals(c.prompt_index) for c in plan.choices]
    outcome: list[BaseException | None] = [None]

    async def events():
        started: set[int] = set()
        item = first
        try:
            while item is not None:
                index, chunk = item
                totals[index].add(chunk)
                finish = out.finish_reason(chunk.finish_reason)
                if chunk.text or finish or index not in started:
                    yield out.sse(out.chunk(plan.kind, id, created, model, index, chunk.text, finish,
                                            index not in started, plan.include_usage))
                    started.add(index)
                item = await anext(chunks, None)
            if plan.include_usage:
                yield out.sse(out.usage_chunk(plan.kind, id, created, model, usage(totals)))
        except ApiError as error:  # after the first byte the status is sent: report it in the stream
            outcome[0] = error
            yield out.sse(error.body())
        yield out.DONE

    async def cleanup() -> None:
        await chunks.aclose()
        finish(gateway, plan, span, outcome[0])

    return CleanupStreamingResponse(events(), cleanup, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---- tracing ---------------------------------------------------------------------------------------
def start_span(request: Request, plan: Plan):
    """A SERVER span for the request, child of the caller's W3C traceparent; the scheduler's spans
    become its children through the gRPC metadata. INVALID_SPAN (does nothing) when tracing is off."""
    if not tracing.enabled():
        return INVALID_SPAN
    parent = propagate.extract(dict(request.headers))
    return tracing.tracer().start_span(f"gateway {request.url.path}", context=parent, kind=SpanKind.SERVER,
                                       attributes={"dspark.choices": len(plan.choices), "dspark.stream": plan.stream,
                                                   "http.route": request.url.path})


def finish(gateway: Gateway, plan: Plan, span, error: BaseException | None) -> None:
    """Once per request, however it ended: give back its concurrency slots and end its span."""
    gateway.release(len(plan.choices))
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()
