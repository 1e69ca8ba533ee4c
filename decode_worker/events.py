"""Events a decode worker's scheduler emits on each request's stream."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from engine.step import TokenLogprobs


@dataclass(frozen=True)
class Reserved:
    """Blocks were allocated: the prefill side may write into ``block_ids``."""

    transfer_id: str
    generation: int
    block_ids: list[int]


@dataclass(frozen=True)
class Tokens:
    """New tokens; ``finish_reason`` ("stop" / "length" / "abort") on the last event."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    finish_reason: str | None = None


@dataclass(frozen=True)
class Failed:
    """The request ended with an error (ends the stream with this gRPC status)."""

    code: grpc.StatusCode
    message: str


DecodeEventT = Reserved | Tokens | Failed
