"""One GenerateMany stream to a verifier, shared by every request routed there.

A verifier step that moves 16 requests then costs one message here, not 16: the per-message
work of gRPC (~60-110 us of CPU at each end on loopback) is paid per step, not per token.
Requests get their chunks from a queue of their own; when the stream breaks, every request on it
gets the error and resumes elsewhere, as it would had its own call broken.
"""
from __future__ import annotations

import asyncio
import itertools

import grpc

from dspark.proto_gen.v1 import verifier_pb2, verifier_pb2_grpc

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class StreamError(Exception):
    """A request's call ended without its final chunk: a refusal from the verifier (a verdict on
    the request, e.g. INVALID_ARGUMENT) or the stream breaking (UNAVAILABLE and the like)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class VerifierStream:
    def __init__(self, stub: verifier_pb2_grpc.VerifierStub):
        self._commands: asyncio.Queue = asyncio.Queue()
        self._queues: dict[int, asyncio.Queue] = {}
        self._keys = itertools.count(1)
        self.broken: StreamError | None = None
        self._call = stub.GenerateMany(self._outgoing())
        self._reader = asyncio.create_task(self._read())

    async def _outgoing(self):
        while True:
            yield await self._commands.get()

    async def _read(self) -> None:
        try:
            async for batch in self._call:
                for item in batch.chunks:
                    queue = self._queues.get(item.key)
                    if queue is not None:
                        queue.put_nowait(item)
            error = StreamError(grpc.StatusCode.UNAVAILABLE, "the verifier ended the stream")
        except grpc.aio.AioRpcError as rpc_error:
            error = StreamError(rpc_error.code(), rpc_error.details() or "")
        except asyncio.CancelledError:
            error = StreamError(grpc.StatusCode.CANCELLED, "stream closed")
        self.broken = error
        for queue in self._queues.values():
            queue.put_nowait(error)

    def start(self, routed: verifier_pb2.RoutedGenerateRequest, trace_context: dict[str, str]) -> int:
        """Start a request; its chunks come from chunks(key)."""
        key = next(self._keys)
        queue = self._queues[key] = asyncio.Queue()
        if self.broken is not None:
            queue.put_nowait(self.broken)
        else:
            self._commands.put_nowait(verifier_pb2.StreamCommand(key=key, start=routed, trace_context=trace_context))
        return key

    async def chunks(self, key: int):
        """The request's chunks up to its final one; raises StreamError if it ends otherwise."""
        queue = self._queues[key]
        while True:
            item = await queue.get()
            if isinstance(item, StreamError):
                raise item
            if not item.HasField("chunk"):
                self._queues.pop(key, None)  # refused: the verifier holds nothing for it
                raise StreamError(_CODES.get(item.status_code, grpc.StatusCode.UNKNOWN), item.status_message)
            if item.chunk.finish_reason:
                self._queues.pop(key, None)  # the last chunk: the verifier has let it go
            yield item.chunk

    def finish(self, key: int) -> None:
        """Forget a request; if it had not ended, tell the verifier to free its slot."""
        if self._queues.pop(key, None) is not None and self.broken is None:
            self._commands.put_nowait(verifier_pb2.StreamCommand(key=key, cancel=True))

    def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()
