from thinkserve.protos.thinkserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PriorityClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_CLASS_UNSPECIFIED: _ClassVar[PriorityClass]
    PRIORITY_CLASS_INTERACTIVE: _ClassVar[PriorityClass]
    PRIORITY_CLASS_STANDARD: _ClassVar[PriorityClass]
    PRIORITY_CLASS_BATCH: _ClassVar[PriorityClass]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class EarlyStop(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EARLY_STOP_UNSPECIFIED: _ClassVar[EarlyStop]
    EARLY_STOP_NONE: _ClassVar[EarlyStop]
    EARLY_STOP_UNBEATABLE: _ClassVar[EarlyStop]
    EARLY_STOP_ADAPTIVE: _ClassVar[EarlyStop]

class ReasoningEffort(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REASONING_EFFORT_UNSPECIFIED: _ClassVar[ReasoningEffort]
    REASONING_EFFORT_LOW: _ClassVar[ReasoningEffort]
    REASONING_EFFORT_MEDIUM: _ClassVar[ReasoningEffort]
    REASONING_EFFORT_HIGH: _ClassVar[ReasoningEffort]
PRIORITY_CLASS_UNSPECIFIED: PriorityClass
PRIORITY_CLASS_INTERACTIVE: PriorityClass
PRIORITY_CLASS_STANDARD: PriorityClass
PRIORITY_CLASS_BATCH: PriorityClass
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
EARLY_STOP_UNSPECIFIED: EarlyStop
EARLY_STOP_NONE: EarlyStop
EARLY_STOP_UNBEATABLE: EarlyStop
EARLY_STOP_ADAPTIVE: EarlyStop
REASONING_EFFORT_UNSPECIFIED: ReasoningEffort
REASONING_EFFORT_LOW: ReasoningEffort
REASONING_EFFORT_MEDIUM: ReasoningEffort
REASONING_EFFORT_HIGH: ReasoningEffort

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "n", "priority", "thinking_budget", "early_stop", "reasoning_effort")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    THINKING_BUDGET_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOP_FIELD_NUMBER: _ClassVar[int]
    REASONING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _common_pb2.TokenIds
    sampling: SamplingParams
    n: int
    priority: PriorityClass
    thinking_budget: int
    early_stop: EarlyStop
    reasoning_effort: ReasoningEffort
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., n: _Optional[int] = ..., priority: _Optional[_Union[PriorityClass, str]] = ..., thinking_budget: _Optional[int] = ..., early_stop: _Optional[_Union[EarlyStop, str]] = ..., reasoning_effort: _Optional[_Union[ReasoningEffort, str]] = ...) -> None: ...

class BranchDelta(_message.Message):
    __slots__ = ("index", "token_ids", "text", "num_tokens", "finish_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    num_tokens: int
    finish_reason: FinishReason
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., num_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class Branch(_message.Message):
    __slots__ = ("index", "token_ids", "text", "finish_reason", "answer")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    answer: str
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., answer: _Optional[str] = ...) -> None: ...

class Vote(_message.Message):
    __slots__ = ("answer", "count", "branch_indices")
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    BRANCH_INDICES_FIELD_NUMBER: _ClassVar[int]
    answer: str
    count: int
    branch_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, answer: _Optional[str] = ..., count: _Optional[int] = ..., branch_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class FinalResult(_message.Message):
    __slots__ = ("branches", "answer", "votes", "best_branch", "cancelled_branches", "early_stop_rule")
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    VOTES_FIELD_NUMBER: _ClassVar[int]
    BEST_BRANCH_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOP_RULE_FIELD_NUMBER: _ClassVar[int]
    branches: _containers.RepeatedCompositeFieldContainer[Branch]
    answer: str
    votes: _containers.RepeatedCompositeFieldContainer[Vote]
    best_branch: int
    cancelled_branches: int
    early_stop_rule: str
    def __init__(self, branches: _Optional[_Iterable[_Union[Branch, _Mapping]]] = ..., answer: _Optional[str] = ..., votes: _Optional[_Iterable[_Union[Vote, _Mapping]]] = ..., best_branch: _Optional[int] = ..., cancelled_branches: _Optional[int] = ..., early_stop_rule: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "recomputed_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    recomputed_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., recomputed_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queued_ms", "prefill_ms", "handoff_ms", "ttft_ms", "total_ms", "migrations", "resumes", "prefill_instance", "decode_instances", "promotions", "predicted_tokens")
    QUEUED_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    queued_ms: float
    prefill_ms: float
    handoff_ms: float
    ttft_ms: float
    total_ms: float
    migrations: int
    resumes: int
    prefill_instance: str
    decode_instances: _containers.RepeatedScalarFieldContainer[str]
    promotions: int
    predicted_tokens: int
    def __init__(self, queued_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., handoff_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., migrations: _Optional[int] = ..., resumes: _Optional[int] = ..., prefill_instance: _Optional[str] = ..., decode_instances: _Optional[_Iterable[str]] = ..., promotions: _Optional[int] = ..., predicted_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "deltas", "final", "usage", "timings")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    deltas: _containers.RepeatedCompositeFieldContainer[BranchDelta]
    final: FinalResult
    usage: Usage
    timings: Timings
    def __init__(self, request_id: _Optional[str] = ..., deltas: _Optional[_Iterable[_Union[BranchDelta, _Mapping]]] = ..., final: _Optional[_Union[FinalResult, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...
