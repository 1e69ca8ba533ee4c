"""Per-request state owned by a worker's scheduler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.sampling_params import sampling_param
from engine.block_pool import blocks_needed
from engine.sampling import SamplingOptions

if TYPE_CHECKING:
    from engine.structured_output import GrammarState


@dataclass(frozen=True)
class RequestParams:
    """Resolved generation limits and sampling of one request (router applied defaults).

    Built from the wire by :func:`serving.convert.request_from_proto`; the fields
    besides ``sampling`` are the parameters of :mod:`common.sampling_params` with
    target ``REQUEST``.

    Attributes:
        max_tokens: new tokens to generate at most (>= 1).
        sampling: temperature / top-p / top-k / min-p / seed / logprobs / penalties /
            logit bias.
        stop_token_ids: ids that end generation (included in the output).
        ignore_eos: keep going past EOS.
        prompt_logprobs: top alternatives of each prompt token's logprob, computed by the prefill
            worker (vLLM's ``prompt_logprobs``); None: none.
    """

    max_tokens: int
    sampling: SamplingOptions
    stop_token_ids: tuple[int, ...] = sampling_param("stop_token_ids").default
    ignore_eos: bool = sampling_param("ignore_eos").default
    prompt_logprobs: int | None = sampling_param("prompt_logprobs").default


class RequestStatus(enum.Enum):
    WAITING = "waiting"              # queued for prefill (prefill) / for blocks (decode)
    PREFILLING = "prefilling"        # some prompt chunks computed
    TRANSFERRING = "transferring"    # KV on the wire (both sides)
    RUNNING = "running"              # in the decode batch
    PREEMPTED = "preempted"          # blocks taken back; resumes by recomputing its KV
    RECOMPUTING = "recomputing"      # rebuilding its KV locally after a preemption
    FINISHED = "finished"


@dataclass
class Request:
    """A request inside one worker. Only its scheduler mutates it.

    Attributes:
        prompt_token_ids: prompt tokens.
        output_token_ids: tokens generated so far (decode side includes the first
            token sampled by the prefill worker). A migrated request starts with the
            tokens its earlier workers generated (``WorkerRequest.output_token_ids``):
            they count as outputs everywhere (penalties, ``max_tokens``, stop checks),
            and its KV covers :attr:`all_token_ids`.
        block_table: KV blocks, append-only.
        num_computed: tokens whose K/V are in the cache.
        grammar: the structured output's state (:class:`engine.structured_output.GrammarState`),
            or None: unconstrained.
        bad_words: token-id sequences the output may not contain (:mod:`engine.bad_words`).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: RequestParams
    transfer_id: str = ""
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    generator: torch.Generator | None = None
    arrival_s: float = field(default_factory=time.monotonic)
    grammar: GrammarState | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def max_blocks(self, block_size: int) -> int:
        """Blocks this request can ever need (prompt + max_tokens; the last sampled
        token never enters the cache)."""
        return blocks_needed(len(self.prompt_token_ids) + self.params.max_tokens - 1, block_size)
