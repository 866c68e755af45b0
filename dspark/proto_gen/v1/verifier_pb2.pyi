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

class SetVerifyBudgetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
