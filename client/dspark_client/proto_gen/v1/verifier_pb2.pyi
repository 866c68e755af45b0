from . import generation_pb2 as _generation_pb2
from . import load_pb2 as _load_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResumeInfo(_message.Message):
    __slots__ = ("streamed_token_ids", "streamed_text", "metrics")
    STREAMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STREAMED_TEXT_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    streamed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    streamed_text: str
    metrics: _generation_pb2.SpecMetrics
    def __init__(self, streamed_token_ids: _Optional[_Iterable[int]] = ..., streamed_text: _Optional[str] = ..., metrics: _Optional[_Union[_generation_pb2.SpecMetrics, _Mapping]] = ...) -> None: ...

class RoutedGenerateRequest(_message.Message):
    __slots__ = ("request", "resume")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    request: _generation_pb2.GenerateRequest
    resume: ResumeInfo
    def __init__(self, request: _Optional[_Union[_generation_pb2.GenerateRequest, _Mapping]] = ..., resume: _Optional[_Union[ResumeInfo, _Mapping]] = ...) -> None: ...

class StreamCommand(_message.Message):
    __slots__ = ("key", "start", "cancel", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KEY_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    key: int
    start: RoutedGenerateRequest
    cancel: bool
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, key: _Optional[int] = ..., start: _Optional[_Union[RoutedGenerateRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class KeyedChunk(_message.Message):
    __slots__ = ("key", "chunk", "status_code", "status_message")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    key: int
    chunk: _generation_pb2.GenerateChunk
    status_code: int
    status_message: str
    def __init__(self, key: _Optional[int] = ..., chunk: _Optional[_Union[_generation_pb2.GenerateChunk, _Mapping]] = ..., status_code: _Optional[int] = ..., status_message: _Optional[str] = ...) -> None: ...

class ChunkBatch(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[KeyedChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[KeyedChunk, _Mapping]]] = ...) -> None: ...

class SetVerifyBudgetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
