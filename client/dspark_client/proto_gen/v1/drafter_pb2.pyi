from . import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SequenceUpdate(_message.Message):
    __slots__ = ("request_id", "hidden", "tokens", "anchor_token", "context_len", "temperature", "release", "seed", "trace_context", "ahead")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    hidden: _tensor_pb2.Tensor
    tokens: _containers.RepeatedScalarFieldContainer[int]
    anchor_token: int
    context_len: int
    temperature: float
    release: bool
    seed: int
    trace_context: _containers.ScalarMap[str, str]
    ahead: int
    def __init__(self, request_id: _Optional[str] = ..., hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., anchor_token: _Optional[int] = ..., context_len: _Optional[int] = ..., temperature: _Optional[float] = ..., release: _Optional[bool] = ..., seed: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., ahead: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("step", "sequences", "context_only")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_ONLY_FIELD_NUMBER: _ClassVar[int]
    step: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceUpdate]
    context_only: bool
    def __init__(self, step: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceUpdate, _Mapping]]] = ..., context_only: _Optional[bool] = ...) -> None: ...

class SequenceDraft(_message.Message):
    __slots__ = ("request_id", "tokens", "confidence_logits", "support_ids", "support_probs", "context_missing")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_LOGITS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_PROBS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_MISSING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    confidence_logits: _tensor_pb2.Tensor
    support_ids: _tensor_pb2.Tensor
    support_probs: _tensor_pb2.Tensor
    context_missing: bool
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., confidence_logits: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., support_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., support_probs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., context_missing: _Optional[bool] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("step", "sequences")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    step: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceDraft]
    def __init__(self, step: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceDraft, _Mapping]]] = ...) -> None: ...

class DrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterInfoResponse(_message.Message):
    __slots__ = ("kind", "version", "gamma", "target_layers", "hidden_size", "target_model", "has_confidence", "sts_temperatures", "drafts_ahead")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    HAS_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    STS_TEMPERATURES_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    kind: str
    version: str
    gamma: int
    target_layers: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    target_model: str
    has_confidence: bool
    sts_temperatures: _tensor_pb2.Tensor
    drafts_ahead: bool
    def __init__(self, kind: _Optional[str] = ..., version: _Optional[str] = ..., gamma: _Optional[int] = ..., target_layers: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., target_model: _Optional[str] = ..., has_confidence: _Optional[bool] = ..., sts_temperatures: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., drafts_ahead: _Optional[bool] = ...) -> None: ...
