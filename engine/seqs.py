"""The step entries (:class:`engine.step.ScheduledSeq`) a worker's scheduler plans for a request.

Shared by the prefill and decode schedulers, so a sampling step carries the same inputs whoever
plans it: the request's histories by reference (penalties), its early-stop bans (``min_tokens``),
its bad words' bans and its structured output's mask of the next token.
"""

from __future__ import annotations

from engine.bad_words import banned_next
from engine.prompt_logprobs import prompt_next_ids
from engine.request import Request
from engine.step import ScheduledSeq
from engine.stop_check import early_stop_ids
from engine.structured_output import next_token_bitmask


def compute_seq(req: Request, tokens: list[int], num_computed: int, prompt_logprobs: bool = False) -> ScheduledSeq:
    """Compute the KV of ``tokens`` (``req``'s tokens from position ``num_computed``); sample nothing.
    With ``prompt_logprobs`` (a prefill worker's step), also the prompt logprobs the request asks for."""
    return ScheduledSeq(req.request_id, tokens, num_computed, req.block_table, False, req.params.sampling,
                        req.generator, req.prompt_token_ids, req.output_token_ids,
                        **_prompt_fields(req, tokens, num_computed, prompt_logprobs))


def sampling_seq(req: Request, tokens: list[int], num_computed: int, eos_token_ids: tuple[int, ...],
                 prompt_logprobs: bool = False) -> ScheduledSeq:
    """Compute the KV of ``tokens`` and sample ``req``'s next token after them (``prompt_logprobs``: as
    :func:`compute_seq`)."""
    return ScheduledSeq(req.request_id, tokens, num_computed, req.block_table, True, req.params.sampling,
                        req.generator, req.prompt_token_ids, req.output_token_ids,
                        early_stop_ids(req, eos_token_ids), next_token_bitmask(req),
                        banned_ids=banned_next(req.bad_words, req.output_token_ids) if req.bad_words else (),
                        **_prompt_fields(req, tokens, num_computed, prompt_logprobs))


def _prompt_fields(req: Request, tokens: list[int], num_computed: int, wanted: bool) -> dict:
    if not wanted or req.params.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": req.params.prompt_logprobs,
            "prompt_next_ids": prompt_next_ids(req.prompt_token_ids, num_computed, len(tokens))}
