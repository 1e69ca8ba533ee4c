"""Conversions between the wire and the engine's types, shared by the worker servers.

The engine knows no wire format; the prefill, decode and colocated workers convert
at their edges:

* :func:`request_from_proto`: the router's resolved ``WorkerRequest`` -> an engine
  :class:`~engine.request.Request` (sampling fields by iterating
  :mod:`common.sampling_params`);
* :func:`logprobs_to_proto`: one generated token's :class:`~engine.step.TokenLogprobs`
  -> ``pdcluster.v1.TokenLogprob`` (the decode worker's token stream);
* :func:`logprobs_to_dict` / :func:`logprobs_from_dict`: the msgpack-able form of the
  first token's logprobs carried from the prefill worker to the decode worker (KV
  transfer completion).
"""

from __future__ import annotations

import torch

from common.sampling_params import Target, read_sampling
from common.structured_outputs import read_structured, structured_problem
from engine.reasoning_gate import MAX_GATE_END_TOKENS, MAX_GATE_ENDS, ReasoningGate
from engine.request import Request, RequestParams
from engine.sampling import SamplingOptions, make_generator, skip_draw
from engine.step import TokenLogprobs
from engine.structured_output import GrammarCompiler, GrammarState
from pdcluster.v1 import common_pb2, worker_pb2


def request_from_proto(msg: worker_pb2.WorkerRequest, transfer_id: str, device: torch.device,
                       vocab_size: int | None = None, grammars: GrammarCompiler | None = None) -> Request:
    """Build a worker-side request from the router's resolved ``WorkerRequest``.

    Unset sampling fields resolve to their declared defaults; a seeded request gets
    its own generator on ``device``. A migrated request's ``output_token_ids`` (the
    tokens an earlier worker generated) become the request's first outputs, and its
    generator has skipped their draws (:func:`engine.sampling.skip_draw`), so the next
    token is sampled as output position ``len(output_token_ids)`` of an uninterrupted run.

    The router validates what clients send; these checks guard the internal plane itself (a
    caller with the cluster secret), so a bad request fails alone with INVALID_ARGUMENT instead of
    failing inside a model step.

    Raises:
        ValueError: an empty ``request_id`` or prompt; a prompt or output token id outside
            ``[0, vocab_size)`` (when ``vocab_size`` is given); a sampling field out of range (see
            :class:`SamplingOptions`); or ``output_token_ids`` holding ``max_tokens`` tokens or
            more (nothing left to generate); a structured output that is malformed, does not compile, or
            that ``output_token_ids`` do not follow, or one sent to a worker without ``grammars``; a
            ``reasoning_gate`` with no end sequence, an empty one, too many or too long, or a token id outside
            the vocabulary; an
            empty ``bad_words_token_ids`` entry or one with an id outside the vocabulary.
    """
    if not msg.request_id:
        raise ValueError("request_id is empty")
    if not msg.prompt_token_ids:
        raise ValueError("prompt_token_ids is empty")
    if vocab_size is not None:
        for name, ids in (("prompt_token_ids", msg.prompt_token_ids), ("output_token_ids", msg.output_token_ids)):
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name}[{bad}] = {ids[bad]} is outside the vocabulary [0, {vocab_size})")
    options = SamplingOptions(**read_sampling(msg.sampling, Target.SAMPLER))
    params = RequestParams(sampling=options, **read_sampling(msg.sampling, Target.REQUEST))
    outputs = list(msg.output_token_ids)
    if len(outputs) >= params.max_tokens:
        raise ValueError(f"output_token_ids has {len(outputs)} tokens; it must be fewer than max_tokens "
                         f"({params.max_tokens})")
    grammar = _grammar(msg, grammars, outputs, vocab_size)
    gen = make_generator(options.seed, device) if options.seed is not None else None
    skip_draw(gen, options, len(outputs))
    return Request(msg.request_id, list(msg.prompt_token_ids), params, transfer_id=transfer_id, generator=gen,
                   output_token_ids=outputs, grammar=grammar, bad_words=_bad_words(msg, vocab_size))


def _bad_words(msg: worker_pb2.WorkerRequest, vocab_size: int | None) -> tuple[tuple[int, ...], ...]:
    """``msg``'s bad words' token-id sequences (each non-empty, ids below ``vocab_size`` when given)."""
    words = tuple(tuple(seq.ids) for seq in msg.bad_words_token_ids)
    for i, word in enumerate(words):
        if not word or (vocab_size is not None and max(word) >= vocab_size):
            raise ValueError(f"bad_words_token_ids[{i}] must be 1 or more token ids below the vocabulary size, "
                             f"got {list(word)[:8]}")
    return words


def _grammar(msg: worker_pb2.WorkerRequest, grammars: GrammarCompiler | None, outputs: list[int],
             vocab_size: int | None) -> GrammarState | None:
    """The compiled structured output of ``msg`` (None: none), behind its reasoning gate, past a
    migrated request's ``outputs``."""
    if not msg.HasField("structured_outputs"):
        return None
    problem = structured_problem(msg.structured_outputs)
    if problem:
        raise ValueError(problem)
    if grammars is None:
        raise ValueError("structured_outputs: this worker does not serve structured outputs")
    state = grammars.compile(read_structured(msg.structured_outputs), gate=_gate(msg, vocab_size))
    if not state.advance(outputs):
        raise ValueError(f"output_token_ids[{state.rejected_at}] = {state.rejected} does not follow "
                         "structured_outputs")
    return state


def _gate(msg: worker_pb2.WorkerRequest, vocab_size: int | None) -> ReasoningGate | None:
    """``msg``'s reasoning gate (None: the constraint holds from output 0)."""
    if not msg.HasField("reasoning_gate"):
        return None
    g = msg.reasoning_gate
    opener = g.opener_token_id if g.HasField("opener_token_id") else None
    ends = tuple(tuple(seq.ids) for seq in g.end_token_ids)
    if len(ends) > MAX_GATE_ENDS or any(len(end) > MAX_GATE_END_TOKENS for end in ends):
        raise ValueError(f"reasoning_gate.end_token_ids: at most {MAX_GATE_ENDS} sequences of at most "
                         f"{MAX_GATE_END_TOKENS} tokens")
    ids = [t for end in ends for t in end] + ([] if opener is None else [opener])
    if vocab_size is not None and any(t >= vocab_size for t in ids):
        raise ValueError(f"reasoning_gate: token ids must be below the vocabulary size ({vocab_size})")
    return ReasoningGate(ends, g.thinking, opener)


def logprobs_to_proto(token_id: int, lp: TokenLogprobs | None) -> common_pb2.TokenLogprob:
    """``TokenLogprob`` of ``token_id`` (logprob 0 and no alternatives when ``lp`` is None; ``rank`` 0
    when it has none)."""
    msg = common_pb2.TokenLogprob(token_id=token_id, logprob=lp.logprob if lp else 0.0,
                                  rank=lp.rank if lp and lp.rank else 0)
    for i, v in (lp.top if lp else []):
        msg.top.add(token_id=i, logprob=v)
    return msg


def logprobs_to_dict(lp: TokenLogprobs | None) -> dict | None:
    """``{"logprob": float, "top": [[token_id, logprob], ...]}``, or None."""
    return None if lp is None else {"logprob": lp.logprob, "top": [[int(i), float(v)] for i, v in lp.top]}


def logprobs_from_dict(d: dict | None) -> TokenLogprobs | None:
    """Inverse of :func:`logprobs_to_dict`."""
    return None if d is None else TokenLogprobs(float(d["logprob"]), [(int(i), float(v)) for i, v in d["top"]])
