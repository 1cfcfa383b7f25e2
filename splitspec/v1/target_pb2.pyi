from splitspec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetTargetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "tokenizer_sha256", "eos_token_ids", "max_context", "max_running", "has_draft", "default_shape", "tp_size", "draft_report", "draft_model_name")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SHA256_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    HAS_DRAFT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REPORT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    tokenizer_sha256: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context: int
    max_running: int
    has_draft: bool
    default_shape: _common_pb2.DraftShape
    tp_size: int
    draft_report: _common_pb2.InitReport
    draft_model_name: str
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_sha256: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., max_running: _Optional[int] = ..., has_draft: _Optional[bool] = ..., default_shape: _Optional[_Union[_common_pb2.DraftShape, _Mapping]] = ..., tp_size: _Optional[int] = ..., draft_report: _Optional[_Union[_common_pb2.InitReport, _Mapping]] = ..., draft_model_name: _Optional[str] = ...) -> None: ...

class Admit(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "max_new_tokens", "stop_token_ids", "ignore_eos", "sampling", "speculation", "traceparent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    sampling: _common_pb2.SamplingParams
    speculation: _common_pb2.SpeculationMode
    traceparent: bytes
    def __init__(self, request_id: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationMode, str]] = ..., traceparent: _Optional[bytes] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    def __init__(self, request_id: _Optional[int] = ...) -> None: ...

class SpecPolicy(_message.Message):
    __slots__ = ("entries",)
    class Entry(_message.Message):
        __slots__ = ("max_batch_size", "shape")
        MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
        SHAPE_FIELD_NUMBER: _ClassVar[int]
        max_batch_size: int
        shape: _common_pb2.DraftShape
        def __init__(self, max_batch_size: _Optional[int] = ..., shape: _Optional[_Union[_common_pb2.DraftShape, _Mapping]] = ...) -> None: ...
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[SpecPolicy.Entry]
    def __init__(self, entries: _Optional[_Iterable[_Union[SpecPolicy.Entry, _Mapping]]] = ...) -> None: ...

class ServeRequest(_message.Message):
    __slots__ = ("admit", "cancel", "policy")
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    admit: Admit
    cancel: Cancel
    policy: SpecPolicy
    def __init__(self, admit: _Optional[_Union[Admit, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., policy: _Optional[_Union[SpecPolicy, _Mapping]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("request_id", "token_ids", "finish_reason", "error", "spec", "queue_s", "retryable")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    error: str
    spec: _common_pb2.SpecStats
    queue_s: float
    retryable: bool
    def __init__(self, request_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., error: _Optional[str] = ..., spec: _Optional[_Union[_common_pb2.SpecStats, _Mapping]] = ..., queue_s: _Optional[float] = ..., retryable: _Optional[bool] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ("step", "batch_size", "prefill_tokens", "speculated", "drafted_tokens", "accepted_tokens", "draft_s", "forward_s", "total_s", "waiting", "draft_compute_s", "period_s", "committed_tokens", "graphed", "tree_budget", "first_child_accepted", "forward_launch_s", "forward_launch_cpu_s", "draft_input_tokens", "finished_prompt_tokens", "finished_generated_tokens", "finished_requests", "held_sequences", "catching_up", "draft_unavailable")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATED_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    PERIOD_S_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAPHED_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHILD_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_LAUNCH_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_LAUNCH_CPU_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HELD_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CATCHING_UP_FIELD_NUMBER: _ClassVar[int]
    DRAFT_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    step: int
    batch_size: int
    prefill_tokens: int
    speculated: bool
    drafted_tokens: int
    accepted_tokens: int
    draft_s: float
    forward_s: float
    total_s: float
    waiting: int
    draft_compute_s: float
    period_s: float
    committed_tokens: int
    graphed: bool
    tree_budget: int
    first_child_accepted: _containers.RepeatedScalarFieldContainer[int]
    forward_launch_s: float
    forward_launch_cpu_s: float
    draft_input_tokens: int
    finished_prompt_tokens: int
    finished_generated_tokens: int
    finished_requests: int
    held_sequences: int
    catching_up: bool
    draft_unavailable: bool
    def __init__(self, step: _Optional[int] = ..., batch_size: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., speculated: _Optional[bool] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., draft_s: _Optional[float] = ..., forward_s: _Optional[float] = ..., total_s: _Optional[float] = ..., waiting: _Optional[int] = ..., draft_compute_s: _Optional[float] = ..., period_s: _Optional[float] = ..., committed_tokens: _Optional[int] = ..., graphed: _Optional[bool] = ..., tree_budget: _Optional[int] = ..., first_child_accepted: _Optional[_Iterable[int]] = ..., forward_launch_s: _Optional[float] = ..., forward_launch_cpu_s: _Optional[float] = ..., draft_input_tokens: _Optional[int] = ..., finished_prompt_tokens: _Optional[int] = ..., finished_generated_tokens: _Optional[int] = ..., finished_requests: _Optional[int] = ..., held_sequences: _Optional[int] = ..., catching_up: _Optional[bool] = ..., draft_unavailable: _Optional[bool] = ...) -> None: ...

class ServeEvent(_message.Message):
    __slots__ = ("deltas", "stats", "target_stopping", "draft_report")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TARGET_STOPPING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REPORT_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[TokenDelta]
    stats: StepStats
    target_stopping: bool
    draft_report: _common_pb2.InitReport
    def __init__(self, deltas: _Optional[_Iterable[_Union[TokenDelta, _Mapping]]] = ..., stats: _Optional[_Union[StepStats, _Mapping]] = ..., target_stopping: _Optional[bool] = ..., draft_report: _Optional[_Union[_common_pb2.InitReport, _Mapping]] = ...) -> None: ...
