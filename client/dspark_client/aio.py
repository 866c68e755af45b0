"""asyncio client (grpc.aio); same behaviour as client.Client."""

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from .attempts import Attempts
from .channel import TlsConfig, open_aio_channel
from .proto_gen.v1 import generation_pb2 as pb
from .replicas import Replicas
from .request import COLLECTED_STREAM_INTERVAL_MS, build_request
from .retry import DEFAULT_RETRY, RetryPolicy
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
        retry: RetryPolicy = DEFAULT_RETRY,
        metadata: Metadata = (),
        options: Sequence[tuple[str, object]] = (),
    ):
        self.replicas = Replicas(address, open_aio_channel, tls, options)
        self.address = self.replicas.address
        self.timeout, self.retry, self.metadata = timeout, retry, tuple(metadata)

    async def generate_stream(
        self, prompt: str | None = None, *, timeout: float | None = None, metadata: Metadata = (), **params
    ) -> AsyncIterator[Chunk]:
        attempts = Attempts(self, build_request(prompt, **params), timeout, metadata)
        while True:
            call = attempts.start()
            try:
                async for message in call:
                    yield attempts.take(message)
                return
            except grpc.aio.AioRpcError as error:
                delay = attempts.delay_after(error)
            finally:
                call.cancel()
            await asyncio.sleep(delay)

    async def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        kwargs.setdefault("stream_interval_ms", COLLECTED_STREAM_INTERVAL_MS)
        return collect([chunk async for chunk in self.generate_stream(prompt, **kwargs)])

    async def list_models(self, *, timeout: float | None = None) -> list[pb.ModelInfo]:
        response = await self.replicas.stubs[0].ListModels(pb.ListModelsRequest(), timeout=timeout or self.timeout,
                                               metadata=self.metadata)
        return list(response.models)

    async def close(self) -> None:
        for channel in self.replicas.channels:
            await channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
