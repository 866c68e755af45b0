"""Synchronous client for the public Generation service."""

import time
from collections.abc import Iterator, Sequence

import grpc

from .attempts import Attempts
from .channel import TlsConfig, open_channel
from .proto_gen.v1 import generation_pb2 as pb
from .replicas import Replicas
from .request import COLLECTED_STREAM_INTERVAL_MS, build_request
from .retry import DEFAULT_RETRY, RetryPolicy
from .types import Chunk, GenerationResult, collect

Metadata = Sequence[tuple[str, str]]


class Client:
    """`Client("host:port").generate("Hello", max_tokens=32)`. Keyword arguments of
    generate / generate_stream are those of request.build_request.

    Several addresses ("a:50051,b:50051" or a list) are scheduler replicas: a call that fails
    with UNAVAILABLE goes on at the next one, a broken stream resuming after the last token
    received (retry.py)."""

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        tls: TlsConfig | None = None,
        timeout: float | None = None,  # default deadline per call, retries included
        retry: RetryPolicy = DEFAULT_RETRY,
        metadata: Metadata = (),  # sent with every call (e.g. auth or trace context)
        options: Sequence[tuple[str, object]] = (),  # raw gRPC channel options
    ):
        self.replicas = Replicas(address, open_channel, tls, options)
        self.address = self.replicas.address
        self.timeout, self.retry, self.metadata = timeout, retry, tuple(metadata)

    def generate_stream(
        self, prompt: str | None = None, *, timeout: float | None = None, metadata: Metadata = (), **params
    ) -> Iterator[Chunk]:
        attempts = Attempts(self, build_request(prompt, **params), timeout, metadata)
        while True:
            call = attempts.start()
            try:
                for message in call:
                    yield attempts.take(message)
                return
            except grpc.RpcError as error:
                delay = attempts.delay_after(error)
            finally:
                call.cancel()  # no-op once finished; tells the server when the caller stops early
            time.sleep(delay)

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        kwargs.setdefault("stream_interval_ms", COLLECTED_STREAM_INTERVAL_MS)
        return collect(self.generate_stream(prompt, **kwargs))

    def list_models(self, *, timeout: float | None = None) -> list[pb.ModelInfo]:
        response = self.replicas.stubs[0].ListModels(pb.ListModelsRequest(), timeout=timeout or self.timeout,
                                                     metadata=self.metadata)
        return list(response.models)

    def close(self) -> None:
        for channel in self.replicas.channels:
            channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
