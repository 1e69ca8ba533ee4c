"""Step contracts between a scheduler and its stateless model runner."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.sampling import SamplingOptions


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's work in a step.

    Attributes:
        request_id: owner of the sequence.
        token_ids: the new tokens to run (a whole prompt, a prompt chunk, or the one
            last sampled token in decode).
        num_computed: tokens of the sequence already in the KV cache.
        block_table: KV blocks covering ``num_computed + len(token_ids)`` tokens.
        sample: sample a next token after this step (False for a non-final prefill chunk).
        sampling: sampling options of the request.
        generator: the request's own RNG when it carries a seed, else None.
        prompt_token_ids / output_token_ids: the request's own token lists, by
            reference (not copied per step), read by the sampler for repetition /
            presence / frequency penalties and ``min_tokens``; output excludes the
            token this step samples.
        stop_ids: the ids that would end the request (EOS unless ``ignore_eos``, its stop
            token ids), banned by the sampler while it has generated fewer than
            ``sampling.min_tokens`` tokens; empty when ``min_tokens`` is 0
            (:func:`engine.stop_check.early_stop_ids`).
        token_bitmask: ``[ceil(vocab / 32)]`` int32, the tokens a structured output allows next
            (:func:`engine.structured_output.next_token_bitmask`); None: unconstrained.
        prompt_logprobs: top alternatives of the prompt logprobs this step computes (vLLM's
            ``prompt_logprobs``); None: none.
        prompt_next_ids: the prompt tokens that follow the first ``len(prompt_next_ids)`` of
            ``token_ids``: their logprobs, given everything before, are this step's prompt logprobs.
        banned_ids: ids the sampled token may not be (the request's bad words,
            :func:`engine.bad_words.banned_next`).
    """

    request_id: str
    token_ids: list[int]
    num_computed: int
    block_table: list[int]
    sample: bool
    sampling: SamplingOptions
    generator: torch.Generator | None = None
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    stop_ids: tuple[int, ...] = ()
    token_bitmask: torch.Tensor | None = None
    prompt_logprobs: int | None = None
    prompt_next_ids: Sequence[int] = ()
    banned_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepPlan:
    """The work of one step.

    Attributes:
        seqs: the sequences, in batch order.
        on_layer_done: called with each layer index (ascending) right after that
            layer wrote its K/V for every token of the step, on the stepping thread
            (layer-wise KV streaming). On CUDA the writes are queued on the current
            stream: readers on the same (default) stream see them in order.
    """

    seqs: list[ScheduledSeq]
    on_layer_done: Callable[[int], None] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of a token (sampled, or a prompt token) and the top-n alternatives (natural log);
    ``rank``: 1 + the tokens more likely than it (prompt logprobs; None: not computed)."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass(frozen=True)
class StepOutput:
    """Sampled tokens, one per sequence with ``sample=True``, in plan order.

    Attributes:
        request_ids / token_ids / logprobs: aligned lists.
        forward_s: seconds spent in the model forward + sampling (wall clock).
        prompt_logprobs: request id -> the logprobs of its ``prompt_next_ids`` this step, in order.
    """

    request_ids: list[str]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    forward_s: float
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
