"""vLLM's ``use_beam_search`` on both generation routes: the ``n`` best beams of each prompt.

The search (:mod:`router.beam_search`) runs on the router as vLLM's does: every step sends each
live beam as a one-token greedy request asking ``2 x n`` top logprobs, through the same request
path as any request (admission, placement, prefix cache, migration). The answer is whole, the
``n`` beams best first as choices ``0 .. n-1`` of each prompt, each ending with ``stop`` (EOS) or
``length``. vLLM's ``length_penalty`` (default 1.0) is the exponent of the length in the score.

Beam search ranks by the model's own log-probabilities, so ``temperature`` and ``seed`` change
nothing (taken, as vLLM takes them); a field that would change the answer another way is refused
with 400 naming it: ``stream``, logprobs, stop strings and ids, penalties, ``top_p``/``top_k``/
``min_p``, ``logit_bias``, ``min_tokens``, allowed or bad words, structured outputs, tools,
``echo``, ``prompt_logprobs``. ``n`` is the beam width, 1 to :data:`MAX_BEAM_WIDTH` (``2 x n``
logprobs are at most :data:`common.sampling_params.MAX_LOGPROBS`).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc

from common.sampling_params import MAX_LOGPROBS, sampling_params
from pdcluster.v1 import common_pb2, router_pb2
from router.beam_search import Beam, BeamSearch
from router.core import RequestRouter
from router.errors import RouterError
from router.openai.pump import check_capacity
from router.openai.requests import OpenAIRequestError, SubRequest, field_of
from router.validation import InvalidRequest

if TYPE_CHECKING:
    from collections.abc import Awaitable

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
MAX_BEAM_SEARCHES = 16
"""Beam searches one router runs at once, each on a thread of its own (not the HTTP server's
shared pool, which they would starve); one more is refused with 429 at once."""
STEP_ADMISSION_WAIT_S = 30.0
"""Seconds a step's beam retries while the router is full (admission's 429), before the search fails
with it: searches sharing a full router take turns instead of failing together."""
_SEARCHES = ThreadPoolExecutor(max_workers=MAX_BEAM_SEARCHES, thread_name_prefix="beam-search")
_SLOTS = threading.BoundedSemaphore(MAX_BEAM_SEARCHES)
#: Sampling parameters a beam search takes: the length limit, EOS handling, what does not change the
#: ranking (temperature, seed), and the prompt's own cut and the text's special tokens.
SERVED = frozenset({"max_tokens", "ignore_eos", "temperature", "seed", "truncate_prompt_tokens", "skip_special_tokens"})


def wants_beam_search(body) -> bool:
    """Whether ``body`` asks for a beam search.

    Raises:
        OpenAIRequestError: ``use_beam_search`` is not a boolean.
    """
    value = field_of(body, "use_beam_search")
    if value is not None and not isinstance(value, bool):
        raise OpenAIRequestError(f"use_beam_search must be a boolean, got {type(value).__name__}",
                                 param="use_beam_search")
    return value is True


def check_beam_request(body, subs: list[SubRequest]) -> float:
    """Refuse what a beam search does not serve; returns ``length_penalty``.

    Raises:
        OpenAIRequestError: 400 naming the field (module docstring).
    """
    if body.stream:
        raise OpenAIRequestError("use_beam_search answers whole: stream is not served with it", param="stream")
    if not 1 <= body.n <= MAX_BEAM_WIDTH:
        raise OpenAIRequestError(f"n is the beam width with use_beam_search: 1 to {MAX_BEAM_WIDTH}, got {body.n}",
                                 param="n")
    penalty = field_of(body, "length_penalty")
    penalty = 1.0 if penalty is None else penalty
    try:
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(float(penalty)):
            raise ValueError
    except (ValueError, OverflowError):
        raise OpenAIRequestError(f"length_penalty must be a finite number, got {penalty!r}"[:200],
                                 param="length_penalty") from None
    for name in ("echo", "response_format", "structured_outputs"):
        if field_of(body, name) not in (None, False, {"type": "text"}):
            raise OpenAIRequestError(f"{name} is not served with use_beam_search", param=name)
    first = subs[0]
    if first.tools is not None and first.tools.choice != "none":
        raise OpenAIRequestError("tool calling is not served with use_beam_search (tool_choice \"none\" is)",
                                 param="tool_choice")
    sampling = first.request.sampling
    for p in sampling_params():
        if p.name not in SERVED and p.is_set(sampling) and p.read(sampling) not in _NEUTRAL.get(p.name, (p.default,)):
            raise OpenAIRequestError(f"{p.name} is not served with use_beam_search", param=p.name)
    return float(penalty)


_NEUTRAL = {"top_k": (0, -1)}  # values that ask for nothing besides the default (vLLM's -1: top-k off)


def start_search(core: RequestRouter, subs: list[SubRequest], n: int, penalty: float, eos_ids: frozenset[int],
                 cancelled: threading.Event) -> Awaitable[dict[int, list[router_pb2.GenerateResponse]]]:
    """:func:`search_all` on a search thread of its own, awaitable.

    Raises:
        OpenAIRequestError: 400: ``n`` beams exceed what the router holds at once (no retry could run them).
        RouterError: RESOURCE_EXHAUSTED: :data:`MAX_BEAM_SEARCHES` searches run already.
    """
    check_capacity(core, n, f"n {n} beams", "n")
    if not _SLOTS.acquire(blocking=False):
        raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_BEAM_SEARCHES} beam searches run on this router "
                          "already; retry later", retry_after_ms=1000)

    def run():
        try:
            return search_all(core, subs, n, penalty, eos_ids, cancelled)
        finally:
            _SLOTS.release()

    return asyncio.get_running_loop().run_in_executor(_SEARCHES, run)


def search_all(core: RequestRouter, subs: list[SubRequest], n: int, penalty: float, eos_ids: frozenset[int],
               cancelled: threading.Event) -> dict[int, list[router_pb2.GenerateResponse]]:
    """Every prompt's beam search (``subs``: its ``n`` sub-requests per prompt, the first of each
    read; ``eos_ids``: the model's): choice index -> its one whole message, as
    :meth:`router.openai.responses.ResponseBuilder.whole` takes them.

    Raises:
        RouterError: INVALID_ARGUMENT: the router's checks refused a prompt (named as on the request
            path); a step's request failed (admission past :data:`STEP_ADMISSION_WAIT_S`, no live
            worker, ...); CANCELLED once ``cancelled`` is set.
    """
    choices: dict[int, list] = {}
    counter = itertools.count()
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="beam") as pool:
        for first in subs[::n]:
            try:
                prep = core.validator.prepare(first.request)
            except InvalidRequest as e:  # named as the request path names it (router_error_response)
                raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            limits = core.validator.limits
            search = BeamSearch(n, prep.worker_request.sampling.max_tokens, eos_ids,
                                first.request.sampling.ignore_eos, penalty, limits.max_model_len)
            step = _cluster_step(core, prep.request_id, counter, pool, cancelled)
            beams = search.run(prep.prompt_token_ids, step)
            prompt = len(prep.prompt_token_ids)
            for j, beam in enumerate(beams):
                choices[first.index + j] = [_message(core, beam, prompt, first.request.sampling)]
    return choices


def _cluster_step(core: RequestRouter, base: str, counter, pool: ThreadPoolExecutor, cancelled: threading.Event):
    """A :data:`router.beam_search.StepFn` over the cluster: each sequence a one-token greedy request."""

    def one(seq: list[int], k: int) -> list[tuple[int, float]]:
        req = router_pb2.GenerateRequest(
            request_id=f"{base}-beam{next(counter)}", token_ids=router_pb2.TokenIds(ids=seq),
            sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, ignore_eos=True))
        deadline = time.monotonic() + STEP_ADMISSION_WAIT_S
        while True:
            if cancelled.is_set():
                raise RouterError(grpc.StatusCode.CANCELLED, "the client closed the request")
            try:
                active = core.start(req)
                break
            except RouterError as e:  # the router is full: this beam waits its turn, for a while
                if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
                time.sleep(min(max((e.retry_after_ms or 0) / 1000, 0.05), 1.0))
        messages = list(active.responses())  # one token: a step is short, cancelled between steps
        lp = messages[-1].logprobs[-1]
        return [(t.token_id, t.logprob) for t in lp.top]

    def step(seqs: list[list[int]], k: int) -> list[list[tuple[int, float]]]:
        return list(pool.map(lambda s: one(s, k), seqs))

    return step


def _message(core: RequestRouter, beam: Beam, prompt: int, sampling) -> router_pb2.GenerateResponse:
    """A beam as a whole ``GenerateResponse``: its generated tokens (an ending EOS left out of the text)."""
    generated = list(beam.tokens[prompt:])
    shown = generated[:-1] if beam.finish_reason == "stop" else generated
    skip = sampling.skip_special_tokens if sampling.HasField("skip_special_tokens") else True
    return router_pb2.GenerateResponse(
        token_ids=generated, text=core.tokenizer.decode(shown, skip_special_tokens=skip),
        finish_reason=common_pb2.FINISH_REASON_STOP if beam.finish_reason == "stop" else common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=prompt, completion_tokens=len(generated)))
