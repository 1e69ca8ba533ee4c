"""Messages posted to a decode scheduler's inbox by other threads."""

from __future__ import annotations

import queue
from concurrent.futures import Future
from dataclasses import dataclass

from decode_worker.events import DecodeEventT
from engine.request import Request
from engine.step import TokenLogprobs


@dataclass(frozen=True)
class ReserveMsg:
    request: Request
    stream: queue.SimpleQueue[DecodeEventT]


@dataclass(frozen=True)
class KvDoneMsg:
    transfer_id: str
    generation: int
    first_token_id: int
    first_logprobs: TokenLogprobs | None


@dataclass(frozen=True)
class KvFailedMsg:
    transfer_id: str
    generation: int
    reason: str


@dataclass(frozen=True)
class AbortMsg:
    """End ``request_id``; with ``transfer_id``, only while it is that reservation, and with
    ``stream``, only while its events go to that stream (a ``Reserve`` call that ended aborts its
    own reservation, never a later one of the same id, nor one a refused duplicate collided with)."""

    request_id: str
    transfer_id: str | None = None
    stream: object | None = None


@dataclass(frozen=True)
class FailTransferMsg:
    """The router saw the prefill side of ``transfer_id`` fail; ``reply`` gets the
    :class:`decode_worker.kv_failure.KvFailureOutcome`."""

    request_id: str
    transfer_id: str
    reason: str
    reply: Future
