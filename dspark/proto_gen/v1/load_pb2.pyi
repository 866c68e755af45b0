from . import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpsPoint(_message.Message):
    __slots__ = ("batch_tokens", "step_seconds")
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    batch_tokens: int
    step_seconds: float
    def __init__(self, batch_tokens: _Optional[int] = ..., step_seconds: _Optional[float] = ...) -> None: ...

class DraftCostPoint(_message.Message):
    __slots__ = ("requests", "seconds")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    requests: int
    seconds: float
    def __init__(self, requests: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class VerifierLoad(_message.Message):
    __slots__ = ("verifier_id", "running", "queued", "kv_use", "sps", "verify_budget", "calibration_version", "max_batch", "max_context_tokens", "model", "draft_cost")
    VERIFIER_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    KV_USE_FIELD_NUMBER: _ClassVar[int]
    SPS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COST_FIELD_NUMBER: _ClassVar[int]
    verifier_id: str
    running: int
    queued: int
    kv_use: float
    sps: _containers.RepeatedCompositeFieldContainer[SpsPoint]
    verify_budget: int
    calibration_version: int
    max_batch: int
    max_context_tokens: int
    model: str
    draft_cost: _containers.RepeatedCompositeFieldContainer[DraftCostPoint]
    def __init__(self, verifier_id: _Optional[str] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., kv_use: _Optional[float] = ..., sps: _Optional[_Iterable[_Union[SpsPoint, _Mapping]]] = ..., verify_budget: _Optional[int] = ..., calibration_version: _Optional[int] = ..., max_batch: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., model: _Optional[str] = ..., draft_cost: _Optional[_Iterable[_Union[DraftCostPoint, _Mapping]]] = ...) -> None: ...

class Calibration(_message.Message):
    __slots__ = ("drafter_version", "version", "temperatures")
    DRAFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURES_FIELD_NUMBER: _ClassVar[int]
    drafter_version: str
    version: int
    temperatures: _tensor_pb2.Tensor
    def __init__(self, drafter_version: _Optional[str] = ..., version: _Optional[int] = ..., temperatures: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class BudgetDecision(_message.Message):
    __slots__ = ("verify_budget", "calibration", "decided", "min_draft_gain")
    VERIFY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    DECIDED_FIELD_NUMBER: _ClassVar[int]
    MIN_DRAFT_GAIN_FIELD_NUMBER: _ClassVar[int]
    verify_budget: int
    calibration: Calibration
    decided: bool
    min_draft_gain: float
    def __init__(self, verify_budget: _Optional[int] = ..., calibration: _Optional[_Union[Calibration, _Mapping]] = ..., decided: _Optional[bool] = ..., min_draft_gain: _Optional[float] = ...) -> None: ...
