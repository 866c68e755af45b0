from . import load_pb2 as _load_pb2
from . import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterVerifierRequest(_message.Message):
    __slots__ = ("address", "model", "drafter_kind", "drafter_version", "gamma", "load", "sts_temperatures")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_KIND_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    STS_TEMPERATURES_FIELD_NUMBER: _ClassVar[int]
    address: str
    model: str
    drafter_kind: str
    drafter_version: str
    gamma: int
    load: _load_pb2.VerifierLoad
    sts_temperatures: _tensor_pb2.Tensor
    def __init__(self, address: _Optional[str] = ..., model: _Optional[str] = ..., drafter_kind: _Optional[str] = ..., drafter_version: _Optional[str] = ..., gamma: _Optional[int] = ..., load: _Optional[_Union[_load_pb2.VerifierLoad, _Mapping]] = ..., sts_temperatures: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("load",)
    LOAD_FIELD_NUMBER: _ClassVar[int]
    load: _load_pb2.VerifierLoad
    def __init__(self, load: _Optional[_Union[_load_pb2.VerifierLoad, _Mapping]] = ...) -> None: ...

class StepReports(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepReport]
    def __init__(self, steps: _Optional[_Iterable[_Union[StepReport, _Mapping]]] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("verifier_id", "step", "batch_size", "batch_tokens", "step_latency_s", "drafter_version", "calibration_version", "confidence_logits", "verified_len", "accepted_len", "checked_confidence_logits", "checked_verified_len", "checked_accepted_len", "sample_of", "draft_resumed")
    VERIFIER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_LOGITS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_LEN_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LEN_FIELD_NUMBER: _ClassVar[int]
    CHECKED_CONFIDENCE_LOGITS_FIELD_NUMBER: _ClassVar[int]
    CHECKED_VERIFIED_LEN_FIELD_NUMBER: _ClassVar[int]
    CHECKED_ACCEPTED_LEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OF_FIELD_NUMBER: _ClassVar[int]
    DRAFT_RESUMED_FIELD_NUMBER: _ClassVar[int]
    verifier_id: str
    step: int
    batch_size: int
    batch_tokens: int
    step_latency_s: float
    drafter_version: str
    calibration_version: int
    confidence_logits: _tensor_pb2.Tensor
    verified_len: _containers.RepeatedScalarFieldContainer[int]
    accepted_len: _containers.RepeatedScalarFieldContainer[int]
    checked_confidence_logits: _tensor_pb2.Tensor
    checked_verified_len: _containers.RepeatedScalarFieldContainer[int]
    checked_accepted_len: _containers.RepeatedScalarFieldContainer[int]
    sample_of: int
    draft_resumed: bool
    def __init__(self, verifier_id: _Optional[str] = ..., step: _Optional[int] = ..., batch_size: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., step_latency_s: _Optional[float] = ..., drafter_version: _Optional[str] = ..., calibration_version: _Optional[int] = ..., confidence_logits: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., verified_len: _Optional[_Iterable[int]] = ..., accepted_len: _Optional[_Iterable[int]] = ..., checked_confidence_logits: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., checked_verified_len: _Optional[_Iterable[int]] = ..., checked_accepted_len: _Optional[_Iterable[int]] = ..., sample_of: _Optional[int] = ..., draft_resumed: _Optional[bool] = ...) -> None: ...
