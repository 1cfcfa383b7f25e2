from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_STATE_UNSPECIFIED: _ClassVar[StepState]
    STEP_STATE_PENDING: _ClassVar[StepState]
    STEP_STATE_RUNNING: _ClassVar[StepState]
    STEP_STATE_OK: _ClassVar[StepState]
    STEP_STATE_FAILED: _ClassVar[StepState]
    STEP_STATE_SKIPPED: _ClassVar[StepState]

class SpeculationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_MODE_AUTO: _ClassVar[SpeculationMode]
    SPECULATION_MODE_ON: _ClassVar[SpeculationMode]
    SPECULATION_MODE_OFF: _ClassVar[SpeculationMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
STEP_STATE_UNSPECIFIED: StepState
STEP_STATE_PENDING: StepState
STEP_STATE_RUNNING: StepState
STEP_STATE_OK: StepState
STEP_STATE_FAILED: StepState
STEP_STATE_SKIPPED: StepState
SPECULATION_MODE_AUTO: SpeculationMode
SPECULATION_MODE_ON: SpeculationMode
SPECULATION_MODE_OFF: SpeculationMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason

class InitStep(_message.Message):
    __slots__ = ("name", "state", "duration_s", "detail", "error_type", "error_message", "traceback")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: StepState
    duration_s: float
    detail: str
    error_type: str
    error_message: str
    traceback: str
    def __init__(self, name: _Optional[str] = ..., state: _Optional[_Union[StepState, str]] = ..., duration_s: _Optional[float] = ..., detail: _Optional[str] = ..., error_type: _Optional[str] = ..., error_message: _Optional[str] = ..., traceback: _Optional[str] = ...) -> None: ...

class InitReport(_message.Message):
    __slots__ = ("service", "rank", "ok", "steps", "started_at_unix_s", "ranks")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    service: str
    rank: int
    ok: bool
    steps: _containers.RepeatedCompositeFieldContainer[InitStep]
    started_at_unix_s: float
    ranks: _containers.RepeatedCompositeFieldContainer[InitReport]
    def __init__(self, service: _Optional[str] = ..., rank: _Optional[int] = ..., ok: _Optional[bool] = ..., steps: _Optional[_Iterable[_Union[InitStep, _Mapping]]] = ..., started_at_unix_s: _Optional[float] = ..., ranks: _Optional[_Iterable[_Union[InitReport, _Mapping]]] = ...) -> None: ...

class GetInitReportRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class SpecStats(_message.Message):
    __slots__ = ("verify_steps", "drafted_tokens", "accepted_tokens", "mean_accepted_length", "plain_steps", "rejected_trees", "acceptance_by_depth")
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_TREES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_BY_DEPTH_FIELD_NUMBER: _ClassVar[int]
    verify_steps: int
    drafted_tokens: int
    accepted_tokens: int
    mean_accepted_length: float
    plain_steps: int
    rejected_trees: int
    acceptance_by_depth: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, verify_steps: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., mean_accepted_length: _Optional[float] = ..., plain_steps: _Optional[int] = ..., rejected_trees: _Optional[int] = ..., acceptance_by_depth: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftShape(_message.Message):
    __slots__ = ("num_draft_tokens", "topk", "num_steps")
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    num_draft_tokens: int
    topk: int
    num_steps: int
    def __init__(self, num_draft_tokens: _Optional[int] = ..., topk: _Optional[int] = ..., num_steps: _Optional[int] = ...) -> None: ...
