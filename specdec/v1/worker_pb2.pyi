from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "stop", "ignore_eos")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class SparseDist(_message.Message):
    __slots__ = ("row_lengths", "token_ids", "probs")
    ROW_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    row_lengths: _containers.RepeatedScalarFieldContainer[int]
    token_ids: bytes
    probs: bytes
    def __init__(self, row_lengths: _Optional[_Iterable[int]] = ..., token_ids: _Optional[bytes] = ..., probs: _Optional[bytes] = ...) -> None: ...

class DraftTask(_message.Message):
    __slots__ = ("req_id", "new_tokens", "num_speculative_tokens", "params", "assumed_tokens", "branches", "side_depth")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    SIDE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_speculative_tokens: int
    params: SamplingParams
    assumed_tokens: _containers.RepeatedScalarFieldContainer[int]
    branches: int
    side_depth: int
    def __init__(self, req_id: _Optional[str] = ..., new_tokens: _Optional[_Iterable[int]] = ..., num_speculative_tokens: _Optional[int] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., assumed_tokens: _Optional[_Iterable[int]] = ..., branches: _Optional[int] = ..., side_depth: _Optional[int] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("req_id", "tokens", "q", "draft_forward_passes", "parents")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    q: SparseDist
    draft_forward_passes: int
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[SparseDist, _Mapping]] = ..., draft_forward_passes: _Optional[int] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftRoundRequest(_message.Message):
    __slots__ = ("tasks", "finished")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[DraftTask]
    finished: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tasks: _Optional[_Iterable[_Union[DraftTask, _Mapping]]] = ..., finished: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftRoundReply(_message.Message):
    __slots__ = ("proposals",)
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[DraftProposal]
    def __init__(self, proposals: _Optional[_Iterable[_Union[DraftProposal, _Mapping]]] = ...) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("kind", "vocab_size", "max_seq_len", "extra_json")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    vocab_size: int
    max_seq_len: int
    extra_json: str
    def __init__(self, kind: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., extra_json: _Optional[str] = ...) -> None: ...

class VerifyTask(_message.Message):
    __slots__ = ("req_id", "new_tokens", "draft_tokens", "q", "params", "parents")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    q: SparseDist
    params: SamplingParams
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_id: _Optional[str] = ..., new_tokens: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[SparseDist, _Mapping]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyOutcome(_message.Message):
    __slots__ = ("req_id", "num_accepted", "tokens", "error")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    num_accepted: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    error: str
    def __init__(self, req_id: _Optional[str] = ..., num_accepted: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("outcomes", "kv_blocks_used", "kv_blocks_total")
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[VerifyOutcome]
    kv_blocks_used: int
    kv_blocks_total: int
    def __init__(self, outcomes: _Optional[_Iterable[_Union[VerifyOutcome, _Mapping]]] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ...) -> None: ...

class VerifyRoundRequest(_message.Message):
    __slots__ = ("tasks", "finished")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[VerifyTask]
    finished: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tasks: _Optional[_Iterable[_Union[VerifyTask, _Mapping]]] = ..., finished: _Optional[_Iterable[str]] = ...) -> None: ...

class VerifyRoundReply(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: VerifyResult
    def __init__(self, result: _Optional[_Union[VerifyResult, _Mapping]] = ...) -> None: ...

class TargetInfo(_message.Message):
    __slots__ = ("vocab_size", "max_seq_len", "eos_token_ids", "kv_block_size", "kv_blocks_total", "model_name", "num_parameters")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    max_seq_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_block_size: int
    kv_blocks_total: int
    model_name: str
    num_parameters: int
    def __init__(self, vocab_size: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., kv_block_size: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., model_name: _Optional[str] = ..., num_parameters: _Optional[int] = ...) -> None: ...
