from splitspec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AttachFeatureMemoryRequest(_message.Message):
    __slots__ = ("path", "check")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CHECK_FIELD_NUMBER: _ClassVar[int]
    path: str
    check: bytes
    def __init__(self, path: _Optional[str] = ..., check: _Optional[bytes] = ...) -> None: ...

class AttachFeatureMemoryReply(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: str
    def __init__(self, error: _Optional[str] = ...) -> None: ...

class FeatureSpan(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class GetDraftStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftStatus(_message.Message):
    __slots__ = ("sequences", "exchanges", "spec", "trees", "replay_misses")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    EXCHANGES_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    REPLAY_MISSES_FIELD_NUMBER: _ClassVar[int]
    sequences: int
    exchanges: int
    spec: _common_pb2.SpecStats
    trees: int
    replay_misses: int
    def __init__(self, sequences: _Optional[int] = ..., exchanges: _Optional[int] = ..., spec: _Optional[_Union[_common_pb2.SpecStats, _Mapping]] = ..., trees: _Optional[int] = ..., replay_misses: _Optional[int] = ...) -> None: ...

class GetDraftInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("kind", "model_name", "vocab_size", "tokenizer_sha256", "needs_hidden_states", "target_hidden_size", "aux_layer_inputs", "target_num_layers", "max_context", "sampled_trees")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SHA256_FIELD_NUMBER: _ClassVar[int]
    NEEDS_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    TARGET_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    AUX_LAYER_INPUTS_FIELD_NUMBER: _ClassVar[int]
    TARGET_NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TREES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    model_name: str
    vocab_size: int
    tokenizer_sha256: str
    needs_hidden_states: bool
    target_hidden_size: int
    aux_layer_inputs: _containers.RepeatedScalarFieldContainer[int]
    target_num_layers: int
    max_context: int
    sampled_trees: bool
    def __init__(self, kind: _Optional[str] = ..., model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_sha256: _Optional[str] = ..., needs_hidden_states: _Optional[bool] = ..., target_hidden_size: _Optional[int] = ..., aux_layer_inputs: _Optional[_Iterable[int]] = ..., target_num_layers: _Optional[int] = ..., max_context: _Optional[int] = ..., sampled_trees: _Optional[bool] = ...) -> None: ...

class SeqDraftInput(_message.Message):
    __slots__ = ("seq_id", "start", "new_tokens", "hidden_states", "hidden_dim", "dtype", "shape", "sampling", "traceparent", "hidden_states_at")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_AT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    hidden_states: bytes
    hidden_dim: int
    dtype: str
    shape: _common_pb2.DraftShape
    sampling: _common_pb2.SamplingParams
    traceparent: bytes
    hidden_states_at: FeatureSpan
    def __init__(self, seq_id: _Optional[int] = ..., start: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., hidden_states: _Optional[bytes] = ..., hidden_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Union[_common_pb2.DraftShape, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., traceparent: _Optional[bytes] = ..., hidden_states_at: _Optional[_Union[FeatureSpan, _Mapping]] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("step", "seqs", "release_ids", "traceparent", "feature_memory", "mailbox")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    FEATURE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    MAILBOX_FIELD_NUMBER: _ClassVar[int]
    step: int
    seqs: _containers.RepeatedCompositeFieldContainer[SeqDraftInput]
    release_ids: _containers.RepeatedScalarFieldContainer[int]
    traceparent: bytes
    feature_memory: str
    mailbox: str
    def __init__(self, step: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[SeqDraftInput, _Mapping]]] = ..., release_ids: _Optional[_Iterable[int]] = ..., traceparent: _Optional[bytes] = ..., feature_memory: _Optional[str] = ..., mailbox: _Optional[str] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("seq_id", "tokens", "parents", "error", "proposals")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    error: str
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    def __init__(self, seq_id: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ..., proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("tokens", "probs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftReply(_message.Message):
    __slots__ = ("step", "trees", "draft_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    trees: _containers.RepeatedCompositeFieldContainer[DraftTree]
    draft_s: float
    def __init__(self, step: _Optional[int] = ..., trees: _Optional[_Iterable[_Union[DraftTree, _Mapping]]] = ..., draft_s: _Optional[float] = ...) -> None: ...
