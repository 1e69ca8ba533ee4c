"""What a prefill scheduler takes and answers: the contract between
:class:`prefill_worker.scheduler.PrefillScheduler` and its callers (the worker's gRPC
servicer, a colocated worker's decode side, the KV sender).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import grpc

from engine.request import Request
from engine.step import TokenLogprobs
from kvtransfer.progress import LayerProgress


class PrefillError(RuntimeError):
    """A prefill that ended without a delivered KV; ``code`` is the gRPC status to return."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class PrefillResult:
    """A delivered prefill: the first token sampled from the prompt's last position and
    what it cost (bytes, seconds); ``cached_tokens`` counts prompt tokens whose KV came
    from the prefix cache."""

    first_token_id: int
    first_logprobs: TokenLogprobs | None
    kv_bytes_sent: int
    prefill_s: float
    transfer_s: float  # exposed transfer time: from the end of compute to the ack (seconds)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    transfer_total_s: float = 0.0  # whole send, start to ack (seconds); > transfer_s when streamed
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # entry i: prompt token i + 1's


# send_fn(request, progress) -> KV payload bytes sent; blocking; raises on failure. The
# first token and its logprobs (serving.convert.logprobs_to_dict form) come from
# progress.wait_finished(); layers become readable as progress reports them.
SendFn = Callable[[Request, LayerProgress], int]


@dataclass(frozen=True)
class ExternalBlocks:
    """Blocks owned by another scheduler on the same pool (a colocated worker's decode
    side): the prompt's KV is written straight into them, nothing is allocated or freed
    here, and ``still_valid()`` (called on the loop thread before every step) says
    whether the owner still holds them for this request."""

    block_ids: list[int]
    still_valid: Callable[[], bool]
