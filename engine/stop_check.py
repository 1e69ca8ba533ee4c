"""Token-level finish rules shared by every worker kind (EOS, stop ids, length).

Stop *strings* need text and are matched by the router's detokenizer, which
aborts the request on a match (vLLM's output-processor split).
"""

from __future__ import annotations

from engine.request import Request

STOP = "stop"
LENGTH = "length"


def check_finish(req: Request, eos_token_ids: tuple[int, ...], max_model_len: int) -> str | None:
    """Finish reason after ``req``'s newest output token, or None to keep going.

    ``max_tokens`` new tokens or ``max_model_len`` total tokens give ``"length"``, checked first (as
    vLLM v1's ``check_stop``: a stop token sampled as the last token allowed ends by length); then EOS
    (unless ``ignore_eos``) and ``stop_token_ids`` give ``"stop"``; so does a structured output whose
    grammar the outputs ended (it accepted a stop token, ``ignore_eos`` or not) or broke
    (:meth:`engine.structured_output.GrammarState.ended`).
    """
    if len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= max_model_len:
        return LENGTH
    if req.output_token_ids[-1] in ending_ids(req, eos_token_ids):
        return STOP
    if req.grammar is not None and req.grammar.ended(req.output_token_ids):
        return STOP
    return None


def early_stop_ids(req: Request, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The ids that would end ``req`` (EOS unless ``ignore_eos``, its ``stop_token_ids``), which
    the sampler bans until it has generated ``min_tokens`` tokens; ``()`` when ``min_tokens`` is 0
    or already reached (nothing to ban)."""
    if len(req.output_token_ids) >= req.params.sampling.min_tokens:
        return ()
    return ending_ids(req, eos_token_ids)


def ending_ids(req: Request, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The ids that end ``req`` when sampled: EOS unless ``ignore_eos``, and its ``stop_token_ids``."""
    return (() if req.params.ignore_eos else tuple(eos_token_ids)) + tuple(req.params.stop_token_ids)
