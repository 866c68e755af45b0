"""asyncio client (grpc.aio); same behaviour as client.Client."""

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from .channel import TlsConfig, open_aio_channel, split_addresses
from .errors import from_rpc_error
from .proto_gen.v1 import generation_pb2 as pb
from .proto_gen.v1 import generation_pb2_grpc
from .request import Received, build_request
from .retry import Deadline, RetryPolicy, retry_delay
from .tracing import current_trace_metadata
from .types import Chunk, GenerationResult, collect

Metadata = Sequence[tuple[str, str]]


class AsyncClient:
    """`async with AsyncClient("host:port") as c: r = await c.generate("Hello")`."""

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        tls: TlsConfig | None = None,
        timeout: float | None = None,
        retry: RetryPolicy = RetryPolicy(),
        metadata: Metadata = (),
        options: Sequence[tuple[str, object]] = (),
    ):
        self.addresses = split_addresses(address)
        self.address = ",".join(self.addresses)
        self.timeout = timeout
        self.retry = retry
        self.metadata = tuple(metadata)
        self._channels = [open_aio_channel(a, tls, options) for a in self.addresses]
        self._stubs = [generation_pb2_grpc.GenerationStub(c) for c in self._channels]
        self._stub = self._stubs[0]

    async def generate_stream(
        self, prompt: str | None = None, *, timeout: float | None = None, metadata: Metadata = (), **params
    ) -> AsyncIterator[Chunk]:
        request = build_request(prompt, **params)
        deadline = Deadline(timeout if timeout is not None else self.timeout)
        received = Received()
        attempt = 0
        while True:
            attempt += 1
            stub = self._stubs[(attempt - 1) % len(self._stubs)]  # the next replica after a failure
            # The caller's current span (if any) parents the servers' spans; metadata passed by
            # hand comes last, so its traceparent wins.
            call_metadata = current_trace_metadata() + self.metadata + tuple(metadata)
            call = stub.Generate(received.resume(request), timeout=deadline.remaining(), metadata=call_metadata)
            try:
                async for message in call:
                    received.add(message)
                    yield Chunk.from_proto(message)
                return
            except grpc.aio.AioRpcError as error:
                delay = retry_delay(self.retry, error.code(), attempt, len(received.token_ids), deadline,
                                    resumable=len(self._stubs) > 1)
                if delay is None:
                    raise from_rpc_error(error, self.address, deadline.timeout, len(received.token_ids)) from error
            finally:
                call.cancel()
            await asyncio.sleep(delay)

    async def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        return collect([chunk async for chunk in self.generate_stream(prompt, **kwargs)])

    async def list_models(self, *, timeout: float | None = None) -> list[pb.ModelInfo]:
        response = await self._stub.ListModels(pb.ListModelsRequest(), timeout=timeout or self.timeout, metadata=self.metadata)
        return list(response.models)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
