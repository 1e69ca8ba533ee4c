from pdcluster.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "output_token_ids", "structured_outputs", "bad_words_token_ids", "reasoning_gate")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REASONING_GATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    structured_outputs: _common_pb2.StructuredOutputs
    bad_words_token_ids: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenSequence]
    reasoning_gate: ReasoningGate
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., structured_outputs: _Optional[_Union[_common_pb2.StructuredOutputs, _Mapping]] = ..., bad_words_token_ids: _Optional[_Iterable[_Union[_common_pb2.TokenSequence, _Mapping]]] = ..., reasoning_gate: _Optional[_Union[ReasoningGate, _Mapping]] = ...) -> None: ...

class ReasoningGate(_message.Message):
    __slots__ = ("end_token_ids", "thinking", "opener_token_id")
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    THINKING_FIELD_NUMBER: _ClassVar[int]
    OPENER_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    end_token_ids: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenSequence]
    thinking: bool
    opener_token_id: int
    def __init__(self, end_token_ids: _Optional[_Iterable[_Union[_common_pb2.TokenSequence, _Mapping]]] = ..., thinking: _Optional[bool] = ..., opener_token_id: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request", "transfer_id")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    request: WorkerRequest
    transfer_id: str
    def __init__(self, request: _Optional[_Union[WorkerRequest, _Mapping]] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class KvDestination(_message.Message):
    __slots__ = ("worker_id", "kv_endpoint", "block_ids", "block_size", "generation", "dtype")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    kv_endpoint: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    generation: int
    dtype: str
    def __init__(self, worker_id: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., generation: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("reservation", "tokens")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    reservation: KvDestination
    tokens: TokenDelta
    def __init__(self, reservation: _Optional[_Union[KvDestination, _Mapping]] = ..., tokens: _Optional[_Union[TokenDelta, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request", "transfer_id", "destination")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    request: WorkerRequest
    transfer_id: str
    destination: KvDestination
    def __init__(self, request: _Optional[_Union[WorkerRequest, _Mapping]] = ..., transfer_id: _Optional[str] = ..., destination: _Optional[_Union[KvDestination, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "cached_prompt_tokens", "kv_bytes_sent", "prefill_seconds", "transfer_seconds", "prompt_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    cached_prompt_tokens: int
    kv_bytes_sent: int
    prefill_seconds: float
    transfer_seconds: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, first_token_id: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class WorkerAbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class WorkerAbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class FailTransferRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class FailTransferResponse(_message.Message):
    __slots__ = ("outcome",)
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[FailTransferResponse.Outcome]
        OUTCOME_UNKNOWN_REQUEST: _ClassVar[FailTransferResponse.Outcome]
        OUTCOME_FAILED: _ClassVar[FailTransferResponse.Outcome]
        OUTCOME_RECOMPUTING: _ClassVar[FailTransferResponse.Outcome]
        OUTCOME_KV_COMPLETE: _ClassVar[FailTransferResponse.Outcome]
    OUTCOME_UNSPECIFIED: FailTransferResponse.Outcome
    OUTCOME_UNKNOWN_REQUEST: FailTransferResponse.Outcome
    OUTCOME_FAILED: FailTransferResponse.Outcome
    OUTCOME_RECOMPUTING: FailTransferResponse.Outcome
    OUTCOME_KV_COMPLETE: FailTransferResponse.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    outcome: FailTransferResponse.Outcome
    def __init__(self, outcome: _Optional[_Union[FailTransferResponse.Outcome, str]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "role", "num_waiting", "num_running", "num_free_blocks", "num_total_blocks", "num_finished", "num_failed_transfers", "num_preemptions", "num_kv_recomputes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_RECOMPUTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    num_finished: int
    num_failed_transfers: int
    num_preemptions: int
    num_kv_recomputes: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_finished: _Optional[int] = ..., num_failed_transfers: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_kv_recomputes: _Optional[int] = ...) -> None: ...
