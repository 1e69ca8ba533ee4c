"""Validate a client's ``GenerateRequest`` and resolve it into a worker request.

Every rejection is an :class:`InvalidRequest` whose message names the field or
limit; the router returns it as ``INVALID_ARGUMENT`` before anything is allocated.
Defaults follow vLLM/OpenAI: ``max_tokens`` 16 (clamped to what ``max_model_len``
leaves), ``temperature`` 1.0, ``top_p`` 1.0, ``repetition_penalty`` 1.0; ``min_p``,
``presence_penalty``, ``frequency_penalty`` 0 and an empty ``logit_bias`` are off.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from pdcluster.v1 import common_pb2, router_pb2, worker_pb2

DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20
MAX_ABS_PENALTY = 2.0      # presence / frequency penalty range (OpenAI)
MAX_ABS_LOGIT_BIAS = 100.0  # logit_bias value range (OpenAI)


class InvalidRequest(ValueError):
    """A request field is out of range; the message names the field or the limit."""


@dataclass(frozen=True)
class Limits:
    """Limits of the served model (tokens)."""

    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for the workers."""

    request_id: str
    prompt_token_ids: list[int]
    worker_request: worker_pb2.WorkerRequest
    stop: list[str]
    logprobs: int
    stream: bool


class RequestValidator:
    """Tokenizes (text, token ids or chat messages) and checks every limit.

    Args:
        tokenizer: an HF tokenizer of the served model (chat template included).
        limits: model limits.
    """

    def __init__(self, tokenizer, limits: Limits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    def prepare(self, req: router_pb2.GenerateRequest) -> PreparedRequest:
        """Raises:
            InvalidRequest: naming the offending field or limit.
        """
        ids = self._prompt_ids(req)
        s = req.sampling
        n = len(ids)
        lim = self.limits
        if n >= lim.max_model_len:
            raise InvalidRequest(
                f"prompt has {n} tokens; max_model_len is {lim.max_model_len} "
                f"(prompt + max_tokens must be <= max_model_len)")
        if s.HasField("max_tokens"):
            if s.max_tokens < 1:
                raise InvalidRequest("sampling.max_tokens must be >= 1")
            max_tokens = s.max_tokens
            if n + max_tokens > lim.max_model_len:
                raise InvalidRequest(
                    f"prompt ({n} tokens) + sampling.max_tokens ({max_tokens}) = {n + max_tokens} "
                    f"exceeds max_model_len {lim.max_model_len}")
        else:
            max_tokens = min(DEFAULT_MAX_TOKENS, lim.max_model_len - n)
        temperature = s.temperature if s.HasField("temperature") else 1.0
        if not math.isfinite(temperature) or temperature < 0:
            raise InvalidRequest(f"sampling.temperature must be >= 0, got {temperature}")
        top_p = s.top_p if s.HasField("top_p") else 1.0
        if not (0.0 < top_p <= 1.0):
            raise InvalidRequest(f"sampling.top_p must be in (0, 1], got {top_p}")
        if s.top_k < 0:
            raise InvalidRequest(f"sampling.top_k must be >= 0 (0 disables), got {s.top_k}")
        if s.logprobs > MAX_LOGPROBS:
            raise InvalidRequest(f"sampling.logprobs must be <= {MAX_LOGPROBS}, got {s.logprobs}")
        for t in s.stop_token_ids:
            if t >= lim.vocab_size:
                raise InvalidRequest(f"sampling.stop_token_ids: {t} >= vocab_size {lim.vocab_size}")
        if any(x == "" for x in s.stop):
            raise InvalidRequest("sampling.stop: stop strings must be non-empty")
        repetition_penalty = self._check_penalties(s)
        resolved = common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=s.top_k,
            stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos, logprobs=s.logprobs,
            min_p=s.min_p, repetition_penalty=repetition_penalty, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty, logit_bias=dict(s.logit_bias),
        )
        if s.HasField("seed"):
            resolved.seed = s.seed
        rid = req.request_id or uuid.uuid4().hex
        return PreparedRequest(
            request_id=rid, prompt_token_ids=ids,
            worker_request=worker_pb2.WorkerRequest(request_id=rid, prompt_token_ids=ids, sampling=resolved),
            stop=list(s.stop), logprobs=s.logprobs, stream=req.stream,
        )

    def _check_penalties(self, s: common_pb2.SamplingParams) -> float:
        """Check min_p, the penalties and logit_bias; return the resolved repetition penalty.

        Raises:
            InvalidRequest: naming the field (NaN and infinities are out of range).
        """
        if not 0.0 <= s.min_p <= 1.0:
            raise InvalidRequest(f"sampling.min_p must be in [0, 1], got {s.min_p}")
        repetition_penalty = s.repetition_penalty if s.HasField("repetition_penalty") else 1.0
        if not 0.0 < repetition_penalty < math.inf:
            raise InvalidRequest(f"sampling.repetition_penalty must be > 0, got {repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_ABS_PENALTY <= getattr(s, name) <= MAX_ABS_PENALTY:
                raise InvalidRequest(f"sampling.{name} must be in [-2, 2], got {getattr(s, name)}")
        for token_id, bias in sorted(s.logit_bias.items()):
            if token_id >= self.limits.vocab_size:
                raise InvalidRequest(
                    f"sampling.logit_bias: token id {token_id} >= vocab_size {self.limits.vocab_size}")
            if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                raise InvalidRequest(f"sampling.logit_bias[{token_id}] must be in [-100, 100], got {bias}")
        return repetition_penalty

    def _prompt_ids(self, req: router_pb2.GenerateRequest) -> list[int]:
        kind = req.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequest("prompt: one of text, token_ids or messages is required")
        if kind == "text":
            if not req.text:
                raise InvalidRequest("prompt: text is empty")
            ids = self.tokenizer.encode(req.text, add_special_tokens=True)
        elif kind == "token_ids":
            ids = list(req.token_ids.ids)
            bad = [t for t in ids if t >= self.limits.vocab_size]
            if bad:
                raise InvalidRequest(f"prompt: token_ids: id {bad[0]} >= vocab_size {self.limits.vocab_size}")
        else:
            msgs = [{"role": m.role, "content": m.content} for m in req.messages.messages]
            if not msgs:
                raise InvalidRequest("prompt: messages is empty")
            if any(not m["role"] for m in msgs):
                raise InvalidRequest("prompt: messages: every message needs a role")
            ids = render_chat(self.tokenizer, msgs)
        if not ids:
            raise InvalidRequest("prompt: empty after tokenization")
        return ids


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Render with the model's chat template (generation prompt added), then tokenize
    without adding special tokens again (the template has them)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
