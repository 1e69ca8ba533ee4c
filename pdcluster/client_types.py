"""Plain data of the Python client: results, and the request / response
conversions that need no channel.

:func:`build_request` turns a prompt and sampling keyword arguments (those
declared in :mod:`common.sampling_params`) into a ``GenerateRequest``;
:func:`accumulate` folds ``GenerateResponse`` messages into a
:class:`GenerationResult` (with :class:`Usage` and :class:`TokenLogprob`). The
gRPC client itself is :class:`pdcluster.client.PdclusterClient`, which re-exports
these names.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from common.sampling_params import write_sampling
from common.structured_outputs import write_structured
from pdcluster.v1 import common_pb2, router_pb2

_FINISH_PREFIX = "FINISH_REASON_"

ChatMessageLike = Union[Mapping[str, str], common_pb2.ChatMessage]
Prompt = Union[str, Sequence[int], Sequence[ChatMessageLike]]


@dataclass(frozen=True)
class Usage:
    """Token counts of one finished request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """Natural-log probability of one generated token and its top alternatives.

    ``top`` lists ``(token_id, logprob)`` pairs in the server's order; ``rank`` (prompt logprobs
    only, else None) is 1 + the number of tokens more likely than this one. ``logprob`` is None for
    the first prompt token only (nothing precedes it).
    """

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None

    @classmethod
    def from_proto(cls, lp: common_pb2.TokenLogprob) -> "TokenLogprob":
        return cls(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top], lp.rank or None)


@dataclass(frozen=True)
class ToolCall:
    """One tool call of a chat answer: its id, the function's name and its arguments (JSON text)."""

    id: str
    name: str
    arguments: str


@dataclass
class GenerationResult:
    """The whole result of one request.

    ``finish_reason`` is the enum name without its prefix: ``"STOP"``,
    ``"LENGTH"``, ``"ABORT"``, ``"TOOL_CALLS"`` (the model ended its turn after calls it chose),
    ``"UNSPECIFIED"`` if the server never set it. A chat answer whose tool calls the router reads
    (``chat_options`` ``tool_choice``) has them in ``tool_calls``, not in ``text``; with the router's
    reasoning parser, its thinking is ``reasoning_text`` and ``text`` the rest.
    ``logprobs`` is ``None`` unless the server returned log-probabilities.
    ``stop_reason`` is the stop string (``str``) or stop token id (``int``) that ended the
    request, as vLLM's; ``None`` when an EOS token or a limit ended it. ``prompt_logprobs``
    (asked with ``prompt_logprobs=k``): one per prompt token, the first with its id alone (logprob and
    rank None: nothing precedes it); else ``None``.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    reasoning_text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def finish_reason_name(value: int) -> str:
    """Map a ``FinishReason`` enum value to its short name (``1`` -> ``"STOP"``).

    Values unknown to this client map to their decimal string.
    """
    try:
        name = common_pb2.FinishReason.Name(value)
    except ValueError:
        return str(value)
    return name.removeprefix(_FINISH_PREFIX)


def accumulate(chunks: Iterable[router_pb2.GenerateResponse]) -> GenerationResult:
    """Fold ``GenerateResponse`` messages (one, or a stream of deltas) into a result.

    Raises:
        ValueError: ``chunks`` is empty.
        grpc.RpcError: iterating a live call failed.
    """
    request_id, text_parts, token_ids = "", [], []
    logprobs: list[TokenLogprob] = []
    prompt_logprobs: list[TokenLogprob] = []
    finish, usage, seen, stop = 0, Usage(), False, None
    reasoning: list[str] = []
    calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
    for chunk in chunks:
        seen = True
        request_id = chunk.request_id or request_id
        token_ids.extend(chunk.token_ids)
        text_parts.append(chunk.text)
        reasoning.append(chunk.reasoning_text)
        for piece in chunk.tool_calls:
            call = calls.setdefault(piece.index, ["", "", ""])
            call[0], call[1] = call[0] or piece.id, call[1] or piece.name
            call[2] += piece.arguments
        logprobs.extend(TokenLogprob.from_proto(lp) for lp in chunk.logprobs)
        if chunk.prompt_logprobs and not prompt_logprobs:  # the first prompt token has no logprob
            prompt_logprobs.append(TokenLogprob(chunk.prompt_logprobs[0].token_id, None))
            prompt_logprobs.extend(TokenLogprob.from_proto(lp) for lp in chunk.prompt_logprobs[1:])
        if chunk.finish_reason:
            finish = chunk.finish_reason
        if which := chunk.WhichOneof("stop_reason"):
            stop = getattr(chunk, which)
        if chunk.HasField("usage"):
            u = chunk.usage
            usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
    if not seen:
        raise ValueError("no GenerateResponse message to accumulate")
    return GenerationResult(
        request_id=request_id,
        token_ids=token_ids,
        text="".join(text_parts),
        finish_reason=finish_reason_name(finish),
        usage=usage,
        logprobs=logprobs or None,
        stop_reason=stop,
        prompt_logprobs=prompt_logprobs or None,
        reasoning_text="".join(reasoning),
        tool_calls=[ToolCall(*calls[i]) for i in sorted(calls)],
    )


def _chat_message(msg: ChatMessageLike) -> common_pb2.ChatMessage:
    if isinstance(msg, common_pb2.ChatMessage):
        return msg
    if not isinstance(msg, Mapping):
        raise TypeError(f"chat message must be a mapping, got {type(msg).__name__}")
    role, content, calls = msg.get("role"), msg.get("content"), msg.get("tool_calls") or []
    if content is None and calls:  # an assistant message that only calls tools (OpenAI's null content)
        content = ""
    if not isinstance(role, str) or not isinstance(content, str):
        raise ValueError(f"chat message needs string 'role' and 'content': {msg!r}")
    return common_pb2.ChatMessage(role=role, content=content, tool_calls=[_tool_call(c) for c in calls],
                                  tool_call_id=msg.get("tool_call_id") or "", name=msg.get("name") or "")


def _tool_call(call: Mapping[str, Any]) -> common_pb2.ToolCall:
    """OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}`` (arguments as JSON
    text, or a dict)."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ValueError(f'a tool call needs {{"function": {{"name": ..., "arguments": ...}}}}: {call!r}')
    arguments = fn.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return common_pb2.ToolCall(id=call.get("id") or "", name=fn["name"], arguments=arguments)


def _set_prompt(req: router_pb2.GenerateRequest, prompt: Prompt) -> None:
    if isinstance(prompt, str):
        req.text = prompt
        return
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise TypeError(f"prompt must be str, list[int] or list[dict], got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("prompt list is empty (cannot tell token ids from chat messages)")
    if all(isinstance(m, (Mapping, common_pb2.ChatMessage)) for m in prompt):
        req.messages.messages.extend(_chat_message(m) for m in prompt)
        return
    if any(isinstance(t, bool) for t in prompt):
        raise TypeError("token ids must be integers, not bools")
    try:
        req.token_ids.ids.extend(operator.index(t) for t in prompt)
    except TypeError as exc:
        raise TypeError("prompt list must hold only ints or only chat messages") from exc


def build_request(
    prompt: Prompt, *, request_id: str = "", stream: bool = False, chat_options: Mapping[str, Any] | None = None,
    structured_outputs: Mapping[str, Any] | None = None, **sampling: Any
) -> router_pb2.GenerateRequest:
    """Build a ``GenerateRequest``.

    ``prompt`` selects the oneof: ``str`` -> ``text``, a list of ints ->
    ``token_ids``, a list of ``{"role", "content"}`` dicts (or ``ChatMessage``)
    -> ``messages``. ``sampling`` takes one keyword per parameter declared in
    :data:`common.sampling_params.SAMPLING_PARAMS` (``max_tokens``,
    ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stop_token_ids``,
    ``ignore_eos``, ``logprobs``, ``min_p``, ``repetition_penalty``,
    ``presence_penalty``, ``frequency_penalty``, ``logit_bias``; their ranges,
    defaults and meaning are declared there). ``None`` leaves a field unset, so
    the server applies its default (16 tokens clamped to the context,
    temperature 1.0, top_p 1.0, random seed, repetition_penalty 1.0, the other
    knobs off). A single ``str`` passed as ``stop`` is one stop string;
    ``logit_bias`` maps token id to bias. Value ranges are checked by the server
    (``INVALID_ARGUMENT`` naming the field).

    ``chat_options`` (chat messages only): vLLM's ``add_generation_prompt`` (bool,
    default true), ``continue_final_message`` (bool), ``chat_template_kwargs``
    (a JSON-serializable dict of template variables), ``tools`` (OpenAI's tool objects, given to
    the chat template), OpenAI's ``tool_choice`` (``"none"``, ``"auto"``, ``"required"`` or
    ``{"type": "function", "function": {"name": ...}}``) and ``parallel_tool_calls`` (bool), and
    vLLM's ``include_reasoning`` (bool), checked by the server. The answer's calls come back as
    :attr:`GenerationResult.tool_calls`, its thinking (with the router's reasoning parser) as
    ``reasoning_text``. A message may carry OpenAI's ``tool_calls``, ``tool_call_id`` and ``name``.

    ``structured_outputs``: vLLM's dict, exactly one of ``{"json": schema}`` (a dict or its JSON
    text), ``{"regex": str}``, ``{"choice": [str, ...]}``, ``{"grammar": ebnf}``,
    ``{"json_object": True}``, optionally with ``"disable_any_whitespace": True``
    (:mod:`common.structured_outputs`); the output is constrained to it.

    Raises:
        TypeError: the prompt or a message/token has the wrong type, a sampling
            keyword is not a declared parameter, or a value has the wrong type (also in
            ``structured_outputs``, or a key it does not take).
        ValueError: the prompt list is empty, a message lacks role/content, a
            number does not fit its protobuf field (e.g. a negative seed), or
            ``chat_options`` has an unknown key or comes with a prompt that is no chat.
    """
    req = router_pb2.GenerateRequest(request_id=request_id, stream=stream)
    _set_prompt(req, prompt)
    if chat_options is not None:
        _set_chat_options(req, chat_options)
    write_sampling(req.sampling, sampling)
    if structured_outputs is not None:
        write_structured(req.structured_outputs, structured_outputs)
    return req


_CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message", "parallel_tool_calls", "include_reasoning",
                 "chat_template_kwargs", "tools", "tool_choice")


def _set_chat_options(req: router_pb2.GenerateRequest, options: Mapping[str, Any]) -> None:
    if req.WhichOneof("prompt") != "messages":
        raise ValueError("chat_options need a prompt of chat messages")
    unknown = sorted(set(options) - set(_CHAT_OPTIONS))
    if unknown:
        raise ValueError(f"chat_options: unknown option {unknown[0]!r}; known: {', '.join(_CHAT_OPTIONS)}")
    for flag in _CHAT_OPTIONS[:4]:
        if options.get(flag) is not None:
            setattr(req.messages, flag, options[flag])
    if options.get("chat_template_kwargs"):
        req.messages.chat_template_kwargs = json.dumps(options["chat_template_kwargs"], ensure_ascii=False)
    if options.get("tools"):
        req.messages.tools = json.dumps(list(options["tools"]), ensure_ascii=False)
    choice = options.get("tool_choice")
    if choice is not None:
        req.messages.tool_choice = choice if isinstance(choice, str) else json.dumps(choice, ensure_ascii=False)
