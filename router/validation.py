"""Validate a client's ``GenerateRequest`` and resolve it into a worker request.

Every rejection is an :class:`InvalidRequest` whose message names the field or
limit; the router returns it as ``INVALID_ARGUMENT`` before anything is allocated.
The sampling checks and defaults derive from :mod:`common.sampling_params` (vLLM/OpenAI
defaults: ``max_tokens`` 16 for a text or token-id prompt (OpenAI's completions default) and
what ``max_model_len`` leaves after a chat's prompt (OpenAI's and vLLM's chat default: a chat
ends when the model ends it), clamped to what ``max_model_len`` leaves; ``temperature``
1.0, ``top_p`` 1.0, ``repetition_penalty`` 1.0; the other knobs off; at most 16 stop
strings of at most 256 characters, at most 1024 ``logit_bias`` entries).

Limits checked here, before anything is tokenized: the prompt's size in bytes
(``max_prompt_bytes``: the text, or the chat messages' roles and contents with the chat's
template variables),
the number of chat messages (:data:`MAX_CHAT_MESSAGES`), their roles (:data:`CHAT_ROLES`)
and the request id (declared in :mod:`router.limits`); a structured output's shape and size
(:func:`common.structured_outputs.structured_problem`: the workers compile it). A chat's options (vLLM's
``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``) become a
:class:`router.chat.ChatOptions`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass

from jinja2.exceptions import TemplateError

from common.sampling_params import SamplingParam, Target, sampling_params
from common.structured_outputs import structured_problem
from pdcluster.v1 import common_pb2, router_pb2, worker_pb2
from router.chat import (ChatOptions, control_token_in, json_depth, render_chat, renderer_arguments,
                         template_messages)
from router.limits import CHAT_ROLES, MAX_REQUEST_ID_CHARS, MAX_TEMPLATE_KWARGS_DEPTH, MAX_TOOLS_DEPTH, Limits
from router.reasoning_gate import GateTokens
from router.tool_specs import check_tools


class InvalidRequest(ValueError):
    """A request field is out of range; the message names the field or the limit."""


def prompt_byte_cap(tokenizer, max_model_len: int) -> int:
    """``max_model_len`` x the longest vocabulary entry in UTF-8 bytes: one token covers at
    most that much text, so a longer prompt cannot fit in ``max_model_len`` tokens (for a
    tokenizer whose normalizer does not shrink text)."""
    return max_model_len * max(len(token.encode()) for token in tokenizer.get_vocab())


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for the workers."""

    request_id: str
    prompt_token_ids: list[int]
    worker_request: worker_pb2.WorkerRequest
    stop: list[str]
    logprobs: int
    stream: bool
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True


class RequestValidator:
    """Tokenizes (text, token ids or chat messages) and checks every limit.

    Args:
        tokenizer: an HF tokenizer of the served model (chat template included).
        limits: model limits.
        reasoning_parser: the served model's registered reasoning parser (None: none); a
            constrained request then holds its constraint after the thinking only.
    """

    def __init__(self, tokenizer, limits: Limits, reasoning_parser: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self._gate = None if reasoning_parser is None else GateTokens.of(reasoning_parser, tokenizer)

    def prepare(self, req: router_pb2.GenerateRequest) -> PreparedRequest:
        """Raises:
            InvalidRequest: naming the offending field or limit.
        """
        _check_request_id(req.request_id)
        constrained = req.HasField("structured_outputs")
        if constrained and (problem := structured_problem(req.structured_outputs)):
            raise InvalidRequest(problem)
        keep = self._truncation(req.sampling)
        ids = self._prompt_ids(req, truncating=keep is not None)
        if keep is not None:  # left truncation, as vLLM's
            ids = ids[-keep:]
        n = len(ids)
        chat = req.WhichOneof("prompt") == "messages"
        self._check_length(n, "messages: the rendered chat" if chat else "prompt")
        s = req.sampling
        rid = req.request_id or mint_request_id()
        return PreparedRequest(
            request_id=rid, prompt_token_ids=ids,
            worker_request=worker_pb2.WorkerRequest(
                request_id=rid, prompt_token_ids=ids, sampling=self._resolve_sampling(s, n, chat=chat),
                structured_outputs=req.structured_outputs if constrained else None,
                reasoning_gate=self._gate.gate() if constrained and self._gate else None,
                bad_words_token_ids=[common_pb2.TokenSequence(ids=w) for w in self._bad_words(s.bad_words)]),
            stop=list(s.stop), logprobs=s.logprobs, stream=req.stream,
            include_stop_str_in_output=s.include_stop_str_in_output, min_tokens=s.min_tokens,
            skip_special_tokens=s.skip_special_tokens if s.HasField("skip_special_tokens") else True,
        )

    def _bad_words(self, words) -> list[list[int]]:
        """vLLM's tokenization of ``bad_words`` (``SamplingParams.update_from_tokenizer``): each word,
        its leading whitespace stripped, as is (at the start of the text) and after a space (inside
        it), the second only where it makes a different first token and as many tokens. A word that is
        only whitespace was refused before (its declaration's ``nonblank``, :meth:`_resolve_sampling`).
        """
        out: list[list[int]] = []
        for word in words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out.append(bare)
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        return out

    def tokenize(self, req: router_pb2.GenerateRequest, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids as :meth:`prepare` computes them (text with the tokenizer's special
        tokens unless ``add_special_tokens`` is false, or the rendered chat), without the length check.

        Raises:
            InvalidRequest: an empty prompt, one over ``max_prompt_bytes``, or messages the chat
                checks refuse.
        """
        return self._prompt_ids(req, add_special_tokens)

    def _resolve_sampling(self, s: common_pb2.SamplingParams, prompt_len: int,
                          chat: bool = False) -> common_pb2.SamplingParams:
        """Check every declared parameter (:data:`common.sampling_params.SAMPLING_PARAMS`)
        and return the workers' copy: router-only fields left out, unset fields
        resolved to their defaults (``seed`` stays unset; an unset ``max_tokens`` of a ``chat``
        prompt is what ``max_model_len`` leaves).

        Raises:
            InvalidRequest: ``sampling.<field> ...`` naming the limit (NaN and
                infinities are out of range), a token id >= vocab_size, or a
                ``min_tokens`` above ``max_tokens``.
        """
        resolved = common_pb2.SamplingParams()
        for p in sampling_params():
            value = p.read(s)
            problem = p.problem(value) or p.vocab_problem(value, self.limits.vocab_size)
            if problem:
                raise InvalidRequest(f"sampling.{problem}")
            if p.context_limited:
                value = self._fit_context(p, s, value, prompt_len, chat)
            if p.target is not Target.ROUTER:
                p.write(resolved, value)
        if resolved.min_tokens > resolved.max_tokens:  # as vLLM refuses it
            raise InvalidRequest(f"sampling.min_tokens must be <= max_tokens ({resolved.max_tokens}), "
                                 f"got {resolved.min_tokens}")
        return resolved

    def _fit_context(self, p: SamplingParam, s: common_pb2.SamplingParams, value: int, prompt_len: int,
                     chat: bool) -> int:
        """A set value must fit after the prompt; an unset one is clamped to what is left (a
        chat's unset one is all that is left)."""
        max_model_len = self.limits.max_model_len
        if not p.is_set(s):
            return max_model_len - prompt_len if chat else min(value, max_model_len - prompt_len)
        if prompt_len + value > max_model_len:
            raise InvalidRequest(
                f"sampling.{p.name} ({value}) + prompt ({prompt_len} tokens) = {prompt_len + value} "
                f"exceeds max_model_len {max_model_len}")
        return value

    def _check_length(self, n: int, what: str = "prompt") -> None:
        max_model_len = self.limits.max_model_len
        if n >= max_model_len:
            raise InvalidRequest(
                f"{what} has {n} tokens; max_model_len is {max_model_len} "
                f"(prompt + max_tokens must be <= max_model_len)")

    def _check_bytes(self, what: str, size: int) -> None:
        cap = self.limits.max_prompt_bytes
        if size > cap:
            raise InvalidRequest(f"{what} is {size} bytes; max_prompt_bytes is {cap} (checked before tokenization)")

    def _truncation(self, s: common_pb2.SamplingParams) -> int | None:
        """How many of the prompt's last tokens ``truncate_prompt_tokens`` keeps (``None``: all).

        Raises:
            InvalidRequest: 0, below -1, or above ``max_model_len``.
        """
        if not s.HasField("truncate_prompt_tokens"):
            return None
        k, max_model_len = s.truncate_prompt_tokens, self.limits.max_model_len
        if k == 0 or k < -1:
            raise InvalidRequest(f"sampling.truncate_prompt_tokens must be >= 1 or -1, got {k}")
        if k > max_model_len:  # as vLLM; a prompt still max_model_len long is refused by the length check
            raise InvalidRequest(f"sampling.truncate_prompt_tokens ({k}) must be <= max_model_len {max_model_len}")
        if k == -1:  # vLLM's "the model's length", less the room the output needs
            return max(1, max_model_len - (s.max_tokens if s.HasField("max_tokens") else 1))
        return k

    def _prompt_ids(self, req: router_pb2.GenerateRequest, add_special_tokens: bool = True,
                    truncating: bool = False) -> list[int]:
        kind = req.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequest("prompt: one of text, token_ids or messages is required")
        if kind == "text":
            if not req.text:
                raise InvalidRequest("prompt: text is empty")
            self._check_bytes("prompt: text", len(req.text.encode()))
            ids = self.tokenizer.encode(req.text, add_special_tokens=add_special_tokens)
        elif kind == "token_ids":
            if not req.token_ids.ids:
                raise InvalidRequest("prompt: token_ids is empty")
            if not truncating:
                self._check_length(len(req.token_ids.ids))
            ids = list(req.token_ids.ids)
            bad = [t for t in ids if t >= self.limits.vocab_size]
            if bad:
                raise InvalidRequest(f"prompt: token_ids: id {bad[0]} >= vocab_size {self.limits.vocab_size}")
        else:
            ids = self._chat_ids(req.messages)
        if not ids:
            raise InvalidRequest("prompt: empty after tokenization")
        return ids

    def _chat_ids(self, chat: router_pb2.MessageList) -> list[int]:
        """The rendered chat's token ids, after the count, role and size checks (the template
        variables count in the messages' bytes)."""
        messages = chat.messages
        if not messages:
            raise InvalidRequest("messages is empty (a chat needs at least one message)")
        if len(messages) > self.limits.max_messages:
            raise InvalidRequest(f"messages has {len(messages)} entries; at most {self.limits.max_messages}")
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise InvalidRequest(f"messages[{i}].role {_clip(m.role)} is not a chat role; "
                                     f"one of {', '.join(CHAT_ROLES)}")
        said, kwargs, tools = sum(_message_bytes(m) for m in messages), \
            len(chat.chat_template_kwargs.encode()), len(chat.tools.encode())
        most = "tools" if tools > kwargs else "chat_template_kwargs"
        self._check_bytes(f"{most} (with the messages)" if kwargs + tools > said else "messages", said + kwargs + tools)
        if not getattr(self.tokenizer, "chat_template", None):  # a base model: HF raises a ValueError
            raise InvalidRequest("messages: this model has no chat template, so it serves no chat; "
                                 "send a prompt (/v1/completions) instead")
        options = self._chat_options(chat)
        try:
            items = template_messages(messages)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        for i, item in enumerate(items):  # written as the template's own text, like its variables
            token = control_token_in(self.tokenizer, {k: v for k, v in item.items() if k not in ("role", "content")})
            if token is not None:
                raise InvalidRequest(f"messages[{i}] holds a control token of the model ({token!r}) in a tool "
                                     "call, tool_call_id or name, which the template writes as its own text")
        try:
            return render_chat(self.tokenizer, items, options)
        except (TemplateError, ValueError, TypeError) as e:
            raise InvalidRequest(f"messages: the model's chat template refused them: {_clip(str(e), 200)}") from None

    def _chat_options(self, chat: router_pb2.MessageList) -> ChatOptions:
        """The chat's :class:`ChatOptions`. As in vLLM, ``add_generation_prompt`` and
        ``continue_final_message`` given inside ``chat_template_kwargs`` override the fields."""
        kwargs = _template_kwargs(chat.chat_template_kwargs, self.tokenizer)
        flags = {"add_generation_prompt": chat.add_generation_prompt if chat.HasField("add_generation_prompt")
                 else True, "continue_final_message": chat.continue_final_message}
        for name in flags:
            if name in kwargs:
                if not isinstance(kwargs[name], bool):
                    raise InvalidRequest(f"chat_template_kwargs.{name} must be a boolean, "
                                         f"got {type(kwargs[name]).__name__}")
                flags[name] = kwargs.pop(name)
        try:
            return ChatOptions(**flags, template_kwargs=kwargs, tools=parse_tools(chat.tools, self.tokenizer))
        except ValueError as e:
            raise InvalidRequest(str(e)) from None


def _template_kwargs(text: str, tokenizer) -> dict:
    """``chat_template_kwargs`` (a JSON object; empty: none) as a dict.

    Raises:
        InvalidRequest: not JSON, not an object, or a key naming an argument of the renderer itself.
    """
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"chat_template_kwargs is not valid JSON: {_clip(str(e), 80)}") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"chat_template_kwargs must be a JSON object, got {type(value).__name__}")
    if json_depth(value) > MAX_TEMPLATE_KWARGS_DEPTH:  # the template renderer copies values recursively
        raise InvalidRequest(f"chat_template_kwargs nests deeper than {MAX_TEMPLATE_KWARGS_DEPTH} levels")
    if (token := control_token_in(tokenizer, value)) is not None:
        raise InvalidRequest(f"chat_template_kwargs holds a control token of the model ({token!r}): a template "
                             "variable is written as the template's own text, where it would be a real one")
    reserved = renderer_arguments(tokenizer) - {"add_generation_prompt", "continue_final_message"}
    bad = sorted(k for k in value if k in reserved)
    if bad:
        raise InvalidRequest(f"chat_template_kwargs.{bad[0]}: an argument of the chat template renderer, "
                             "not a template variable")
    return value


def parse_tools(text: str, tokenizer) -> list | None:
    """``MessageList.tools`` (a JSON array; empty: none) as a list.

    Raises:
        InvalidRequest: not JSON, nested too deep, not function tools of OpenAI's shape
            (:func:`router.tool_specs.check_tools`), or holding a control token.
    """
    if not text:
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"tools is not valid JSON: {_clip(str(e), 80)}") from None
    if json_depth(value) > MAX_TOOLS_DEPTH:
        raise InvalidRequest(f"tools nests deeper than {MAX_TOOLS_DEPTH} levels")
    try:
        check_tools(value)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    if (token := control_token_in(tokenizer, value)) is not None:
        raise InvalidRequest(f"tools holds a control token of the model ({token!r}): the template writes the "
                             "tools as its own text, where it would be a real one")
    return value or None


def _message_bytes(m) -> int:
    """A message's bytes the template writes: role, content, name, call id and tool calls."""
    calls = sum(len(c.id.encode()) + len(c.name.encode()) + len(c.arguments.encode()) for c in m.tool_calls)
    return sum(len(x.encode()) for x in (m.role, m.content, m.name, m.tool_call_id)) + calls


_ID_KEY = os.urandom(32)
_ID_SERIAL = itertools.count()


def mint_request_id() -> str:
    """A request id for a request that came without one: 32 hex characters, as ``uuid4().hex``,
    and as unguessable (a client that could predict the next one could take it first and have
    another client's request refused as ALREADY_EXISTS): a serial keyed with a random key drawn at
    import (BLAKE2b, 128 bits). No system call: ``uuid4`` reads ``os.urandom``, ~10-20 us here,
    paid by every refused request of a burst."""
    return hashlib.blake2b(next(_ID_SERIAL).to_bytes(8, "little"), key=_ID_KEY, digest_size=16).hexdigest()


def request_id_problem(rid: str) -> str | None:
    """What is wrong with a client's request id, or ``None``: it travels as gRPC metadata
    (``x-request-id``) and into log lines, so it must be printable ASCII, bounded (the message shows
    it escaped and clipped)."""
    if len(rid) > MAX_REQUEST_ID_CHARS:
        why = f"it has {len(rid)}"
    elif not (rid.isascii() and rid.isprintable()):  # " " to "~"
        i = next(i for i, c in enumerate(rid) if not (c.isascii() and c.isprintable()))  # the same test, per character
        why = f"character {i} ({rid[i]!r}) is not one"
    else:
        return None
    return f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable ASCII characters: {why} (got {_clip(rid)})"


def _check_request_id(rid: str) -> None:
    problem = request_id_problem(rid)
    if problem:
        raise InvalidRequest(problem)


def _clip(text: str, limit: int = 40) -> str:
    """``repr`` of ``text`` cut to ``limit`` characters (error messages stay small)."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")
