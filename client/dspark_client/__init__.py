"""DSpark client SDK: gRPC only, no torch. See client/README.md."""

from .aio import AsyncClient
from .channel import TlsConfig
from .client import Client
from .errors import DeadlineExceeded, DSparkError, Unavailable
from .request import build_request
from .retry import RetryPolicy
from .types import ChatMessage, Chunk, FinishReason, GenerationResult, SpecMetrics

__all__ = [
    "AsyncClient", "ChatMessage", "Chunk", "Client", "DSparkError", "DeadlineExceeded", "FinishReason",
    "GenerationResult", "RetryPolicy", "SpecMetrics", "TlsConfig", "Unavailable", "build_request",
]
