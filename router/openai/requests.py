"""OpenAI request bodies -> the router's ``GenerateRequest`` messages (one per prompt x ``n``).

The sampling fields map one to one, by name, onto the declared parameters
(:mod:`common.sampling_params`, so a new parameter needs no change here; the router's
validator then checks them exactly as for the gRPC API); the differences are:

* ``max_completion_tokens`` (chat) wins over ``max_tokens``;
* ``logprobs``: an int on ``/v1/completions``; on chat a bool, with ``top_logprobs``
  alternatives (the chosen token's logprob needs at least one top entry from the workers,
  trimmed again in the response);
* ``logit_bias`` keys are token ids written as strings;
* ``n`` > 1: sample ``i`` gets ``seed + i`` when a seed is given, so the samples differ;
  ``n`` <= :data:`router.limits.MAX_N`, and prompts x ``n`` <= :data:`router.limits.MAX_CHOICES`.

A constraint is vLLM's ``structured_outputs`` or OpenAI's JSON ``response_format``
(:func:`structured_outputs`). OpenAI fields this server does not serve (``suffix``,
``best_of``, the deprecated functions, chat's ``echo``; tools on completions) and vLLM's extra fields it does not
serve (the old ``guided_*`` names, ``chat_template``, ...) are refused with 400 when a request asks for them
(:func:`refuse_unsupported`); fields nobody declared are ignored.

A string JSON allows but protobuf does not (a lone surrogate, ``"\\ud800"``) and a token id
that does not fit the wire's ``uint32`` are refused here with 400, naming the field.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from common.sampling_params import UINT64_MAX, sampling_params, write_sampling
from common.structured_outputs import write_structured
from pdcluster.v1 import common_pb2, router_pb2
from router.limits import MAX_CHOICES, MAX_N
from router.openai.errors import request_aliases
from router.openai.protocol import CompletionRequest
from router.answer import AnswerReading
from router.tool_choice import ToolChoice, ToolRequestError

_UINT32_LIMIT = 1 << 32
_OPENAI_SHAPED = frozenset({"max_tokens", "logprobs", "stop", "logit_bias"})


class OpenAIRequestError(ValueError):
    """A request body the router refuses before validation (HTTP 400/404)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


@dataclass(frozen=True)
class SubRequest:
    """One generation of an HTTP request: choice ``index``, the message for the router."""

    index: int
    request: router_pb2.GenerateRequest
    top_logprobs: int
    tools: ToolChoice | None = None
    reading: AnswerReading | None = None  # a chat answer's reasoning and tool calls, read by the router


_UNSUPPORTED = (  # (field, the values that ask for nothing, why another value is refused)
    ("suffix", (None, ""), "suffix (text insertion) is not supported"),
    ("best_of", (None, 1), "best_of is not supported; use n"),
    ("tools", (None, []), "tool calling is not supported by this server"),
    ("tool_choice", (None, "none"), "tool calling is not supported by this server"),
    ("functions", (None, []), "function calling is not supported by this server"),
    ("function_call", (None, "none"), "function calling is not supported by this server"),
    # vLLM's extra fields this server does not serve (``vllm/entrypoints/openai/protocol.py``): each
    # changes the answer, so asking for one is refused rather than silently ignored
    ("guided_json", (None,), "guided_json is vLLM's old name: send structured_outputs {\"json\": schema}"),
    ("guided_regex", (None,), "guided_regex is vLLM's old name: send structured_outputs {\"regex\": ...}"),
    ("guided_choice", (None,), "guided_choice is vLLM's old name: send structured_outputs {\"choice\": [...]}"),
    ("guided_grammar", (None,), "guided_grammar is vLLM's old name: send structured_outputs {\"grammar\": ...}"),
    ("guided_whitespace_pattern", (None,), "guided_whitespace_pattern is not served: structured outputs take "
                                           "disable_any_whitespace"),
    ("guided_decoding_backend", (None,), "guided_decoding_backend is not served: structured outputs use xgrammar"),
    ("chat_template", (None,), "chat_template (vLLM's) is not supported: the model's own template is used"),
)


def field_of(body, name: str):
    """``body``'s value of ``name``: a declared field, else one of the extra fields it carries (``None`` if absent)."""
    return getattr(body, name) if name in type(body).model_fields else (body.model_extra or {}).get(name)


def refuse_unsupported(body, served: frozenset[str] = frozenset()) -> None:
    """Refuse an OpenAI field this server knows but does not serve, when the request asks for it
    (``suffix``, ``best_of``, ``guided_json``, ...): ignoring it would answer a
    different question. Fields nobody declared are ignored, as OpenAI's servers do.

    Raises:
        OpenAIRequestError: 400 naming the first such field (of those not ``served`` by the route).
    """
    for name, neutral, why in _UNSUPPORTED:
        if name in served:
            continue
        value = field_of(body, name)
        if any(type(value) is type(n) and value == n for n in neutral):  # typed: 1 is not True
            continue
        if isinstance(neutral[-1], bool) and not isinstance(value, bool):
            raise OpenAIRequestError(f"{name} must be a boolean, got {type(value).__name__}", param=name)
        raise OpenAIRequestError(f"{name}: {why}", param=name, code="unsupported_parameter")


def check_utf8(text: str, what: str, param: str) -> None:
    """Refuse a string protobuf cannot carry (JSON escapes allow lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise OpenAIRequestError(f"{what} is not valid Unicode: {e.reason} at index {e.start}", param=param) from None


INT64_MIN = -(1 << 63)


def _sampling(body, logprobs: int, max_tokens: int | None) -> common_pb2.SamplingParams:
    """The proto sampling of ``body``: every declared parameter (:mod:`common.sampling_params`)
    is read under its own name, from the model's fields or from the extra fields the body
    carries, except the four whose OpenAI shape differs (``max_tokens``, ``logprobs``,
    ``stop``, ``logit_bias``). A negative ``seed`` (vLLM takes any int64) is its two's complement
    as the wire's uint64: distinct seeds stay distinct.

    Raises:
        OpenAIRequestError: a value that does not fit its field (naming it).
    """
    values = {p.name: field_of(body, p.name) for p in sampling_params() if p.name not in _OPENAI_SHAPED}
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        # a token id in ASCII digits, as OpenAI writes it (int() would also take " 5 ", "5_0" and other scripts' digits)
        if not (key.isascii() and key.isdigit()):
            raise OpenAIRequestError(f"logit_bias: key {key!r} is not a token id (decimal digits)",
                                     param="logit_bias")
        bias[int(key)] = value
    if max_tokens is not None and max_tokens < 1:
        name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
        echo = " (0: the prompt alone, with echo)" if isinstance(body, CompletionRequest) else ""
        raise OpenAIRequestError(f"{name} must be >= 1{echo}, got {max_tokens}", param=name)
    if isinstance(values.get("bad_words"), str):  # vLLM's is a list (the client library takes one string too)
        raise OpenAIRequestError("bad_words must be a list of strings", param="bad_words")
    values.update(max_tokens=max_tokens, logprobs=logprobs, logit_bias=bias,
                  stop=[body.stop] if isinstance(body.stop, str) else body.stop)
    if body.seed is not None and not 0 <= body.seed <= UINT64_MAX:  # vLLM takes any int64: as a uint64's bits
        if not INT64_MIN <= body.seed <= UINT64_MAX:
            raise OpenAIRequestError(f"seed must be in [{INT64_MIN}, {UINT64_MAX}], got {body.seed}", param="seed")
        values["seed"] = body.seed % (1 << 64)
    s = common_pb2.SamplingParams()
    for name, value in values.items():
        try:
            write_sampling(s, {name: value})
        except (TypeError, ValueError) as e:  # the message starts with the name: the request's own for it
            field = request_aliases(body).get(name, name)
            raise OpenAIRequestError(field + str(e)[len(name):], param=field) from None
    return s


def structured_outputs(body) -> common_pb2.StructuredOutputs | None:
    """The constraint of ``body``: vLLM's ``structured_outputs`` (:func:`common.structured_outputs.
    write_structured`), or OpenAI's ``response_format``: ``json_object`` (JSON mode) or
    ``json_schema`` (``{"json_schema": {"name": ..., "schema": {...}}}``; ``strict`` is how it is
    served anyway); ``text`` or neither: None.

    Raises:
        OpenAIRequestError: both are given, or one is malformed (naming it).
    """
    given, fmt = field_of(body, "structured_outputs"), field_of(body, "response_format")
    if given is not None and fmt is not None and fmt != {"type": "text"}:
        raise OpenAIRequestError("give response_format or structured_outputs, not both", param="response_format")
    msg = common_pb2.StructuredOutputs()
    try:
        if given is not None:
            write_structured(msg, given)
            return msg
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return common_pb2.StructuredOutputs(json_object=True)
        spec = fmt.get("json_schema") if kind == "json_schema" else None
        if isinstance(spec, dict) and not isinstance(spec.get("schema"), dict):
            raise TypeError("response_format.json_schema.schema must be a JSON schema (an object)")
        if not isinstance(spec, dict):
            raise TypeError('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                            '"json_schema", "json_schema": {"name": ..., "schema": {...}}}')
        write_structured(msg, {"json": spec["schema"]}, field="response_format.json_schema")
        return msg
    except TypeError as e:
        param = "structured_outputs" if given is not None else "response_format"
        raise OpenAIRequestError(str(e), param=param) from None


COMPLETIONS_ROUTE, CHAT_ROUTE = "/v1/completions", "/v1/chat/completions"
ID_PREFIXES = {COMPLETIONS_ROUTE: "cmpl", CHAT_ROUTE: "chatcmpl"}
"""The generation routes and the prefix of their requests' ids (``cmpl-<id>``, ``chatcmpl-<id>``, as vLLM's)."""
REQUEST_ID_HEADER = "X-Request-Id"
"""Request header with the client's id for a request, and response header naming the request's id (the
body's ``id``), as vLLM's with request-id headers on; the router's and workers' log lines about choice
``i`` carry ``<id>-<i>``."""
MAX_CLIENT_REQUEST_ID_CHARS = 128
"""Characters of a client's ``X-Request-Id`` (the choice index and a migrated attempt's suffix
are added to it, within the router's request id limit)."""


def base_id(prefix: str, client_id: str | None) -> str:
    """``<prefix>-<client_id>`` as vLLM names a request from its ``X-Request-Id`` header, else
    ``<prefix>-<random hex>``.

    Raises:
        OpenAIRequestError: ``client_id`` is not 1 to :data:`MAX_CLIENT_REQUEST_ID_CHARS`
            printable ASCII characters.
    """
    if client_id is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not 0 < len(client_id) <= MAX_CLIENT_REQUEST_ID_CHARS or not all("!" <= c <= "~" for c in client_id):
        raise OpenAIRequestError(f"the {REQUEST_ID_HEADER} header must be 1 to {MAX_CLIENT_REQUEST_ID_CHARS} printable "
                                 f"ASCII characters without spaces, got {len(client_id)} characters",
                                 param=REQUEST_ID_HEADER)
    return f"{prefix}-{client_id}"


def expand(prompts: list[dict], body, logprobs: int, top_logprobs: int, max_tokens: int | None, prefix: str,
           client_id: str | None, tools: ToolChoice | None = None) -> tuple[str, list[SubRequest]]:
    """The sub-requests of ``prompts`` x ``body.n`` and their base id; ``tools``' constraint (a
    named or required tool choice) is the structured output.

    Raises:
        OpenAIRequestError: a field out of shape, or ``response_format`` beside a forcing tool choice.
    """
    if body.stream_options is not None and not body.stream:  # as OpenAI and vLLM answer it
        raise OpenAIRequestError("stream_options is only allowed when stream is true", param="stream_options")
    if body.stream and field_of(body, "prompt_logprobs") is not None:  # as vLLM refuses it
        raise OpenAIRequestError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    if not 1 <= body.n <= MAX_N:
        raise OpenAIRequestError(f"n must be in [1, {MAX_N}], got {body.n}", param="n")
    if len(prompts) * body.n > MAX_CHOICES:
        raise OpenAIRequestError(f"{len(prompts)} prompts x n {body.n} = {len(prompts) * body.n} choices; "
                                 f"at most {MAX_CHOICES} per request", param="prompt" if body.n == 1 else "n")
    base = base_id(prefix, client_id)
    constraint = structured_outputs(body)
    forced = tools.constraint if tools is not None else None
    if forced is not None:
        if constraint is not None:
            raise OpenAIRequestError("a named or required tool_choice constrains the answer itself: give no "
                                     "response_format or structured_outputs with it", param="tool_choice")
        try:
            constraint = tools.structured_outputs()
        except ToolRequestError as e:
            raise OpenAIRequestError(str(e), param=e.param) from None
    subs = []
    for p, prompt in enumerate(prompts):
        for j in range(body.n):
            index = p * body.n + j
            sampling = _sampling(body, logprobs, max_tokens)
            if body.seed is not None and j:
                sampling.seed = (body.seed + j) % (1 << 64)
            req = router_pb2.GenerateRequest(request_id=f"{base}-{index}", sampling=sampling, stream=True,
                                             structured_outputs=constraint, **prompt)
            subs.append(SubRequest(index, req, top_logprobs, tools))
    return base, subs


def completion_requests(body: CompletionRequest, client_id: str | None = None) -> tuple[str, list[SubRequest]]:
    """The sub-requests of a ``/v1/completions`` body (choice index = prompt x n + sample) and
    their base id (``cmpl-<client_id>`` with the client's ``X-Request-Id``, as vLLM's).

    Raises:
        OpenAIRequestError: an empty prompt list, a token id out of range, a string that is
            not valid Unicode, ``n`` or ``logprobs`` out of shape.
    """
    refuse_unsupported(body)
    prompt = body.prompt
    if not prompt:
        raise OpenAIRequestError("prompt must not be empty", param="prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    elif not isinstance(prompt[0], (str, list)):
        prompt = [prompt]  # one list of token ids
    wrapped = prompt is not body.prompt  # one prompt given alone: named "prompt", not "prompt[0]"
    prompts = []
    for i, x in enumerate(prompt):
        if isinstance(x, str):
            check_utf8(x, "prompt" if wrapped else f"prompt[{i}]", "prompt")
            prompts.append({"text": x})
        else:
            where = f"prompt[{i}]" if len(prompt) > 1 else "prompt"
            if not x:
                raise OpenAIRequestError(f"{where} is an empty list of token ids", param="prompt")
            bad = [t for t in x if not 0 <= t < _UINT32_LIMIT]
            if bad:
                raise OpenAIRequestError(f"{where}: token id {bad[0]} is out of range: token ids are >= 0 and "
                                         "below the model's vocabulary size", param="prompt")
            prompts.append({"token_ids": router_pb2.TokenIds(ids=x)})
    top = body.logprobs or 0
    if top < 0:
        raise OpenAIRequestError(f"logprobs must be >= 0, got {top}", param="logprobs")
    # ``logprobs: 0`` still asks for the sampled tokens' logprobs (the top list then holds just that token)
    logprobs = 0 if body.logprobs is None else max(top, 1)
    max_tokens = body.max_tokens
    if body.echo:
        _check_echo(body)
        max_tokens = 1 if max_tokens == 0 else max_tokens  # the prompt alone: one token generated, not shown
    base, subs = expand(prompts, body, logprobs, top, max_tokens, ID_PREFIXES[COMPLETIONS_ROUTE], client_id)
    if body.echo and body.logprobs is not None:  # the prompt's logprobs, as many alternatives as asked for
        for sub in subs:
            asked = sub.request.sampling.prompt_logprobs if sub.request.sampling.HasField("prompt_logprobs") else 0
            sub.request.sampling.prompt_logprobs = max(asked, top)
    return base, subs


def _check_echo(body: CompletionRequest) -> None:
    """Raises OpenAIRequestError: ``echo`` with logprobs on a stream (a prompt's logprobs are not
    streamed, as vLLM's ``prompt_logprobs``), ``max_tokens`` 0 on a stream, or with
    ``truncate_prompt_tokens`` (the echoed text would not be the tokens served)."""
    if body.stream and body.logprobs is not None:
        raise OpenAIRequestError("echo with logprobs is not available when stream is true", param="echo")
    if body.stream and body.max_tokens == 0:
        raise OpenAIRequestError("max_tokens 0 (the prompt alone) is not available when stream is true",
                                 param="max_tokens")
    if field_of(body, "truncate_prompt_tokens") is not None:  # the echoed text would not be the prompt served
        raise OpenAIRequestError("echo with truncate_prompt_tokens is not served: send the prompt already cut",
                                 param="echo")
