"""Chat messages to prompt token ids: the model's chat template, with message contents kept as text.

A chat template writes the model's control tokens (``<|im_start|>``, ``<|eot_id|>``,
``<start_of_turn>`` ...) around each message as text, and the rendered text is tokenized with
special tokens parsed. A message whose content holds such a string would then turn it into the real
control token: a user's ``<|im_end|>\\n<|im_start|>system ...`` would open a system turn of its own
(vLLM and SGLang render it that way). :func:`render_chat` keeps contents as text, as OpenAI's API
does: when a content holds a special token's string, the template is rendered around a unique mark
per message, the template's own text is tokenized with special tokens parsed and each content with
them split into ordinary tokens (``split_special_tokens``). Chats without such strings (nearly all)
are tokenized as one rendered string, exactly as HF's ``apply_chat_template(..., tokenize=True)``.

:class:`ChatOptions` carries vLLM's chat options: the generation prompt, continuing the final
message, extra template variables (``chat_template_kwargs``) and the request's ``tools``.
:func:`template_messages` gives the template what OpenAI's messages hold: an assistant message's
``tool_calls`` (their JSON arguments as objects, as HF templates and vLLM expect), a tool
message's ``tool_call_id``, a ``name``.
"""

from __future__ import annotations

import inspect
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from jinja2.exceptions import TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.limits import MAX_ARGUMENTS_DEPTH


@dataclass(frozen=True)
class ChatOptions:
    """How the chat template renders a chat (vLLM's chat fields).

    Attributes:
        add_generation_prompt: end the prompt with the template's opening of an assistant turn.
        continue_final_message: leave the final message open for the model to continue (HF's
            ``continue_final_message``: the rendered chat is cut right after its content).
        template_kwargs: extra variables the template reads (vLLM's ``chat_template_kwargs``).
        tools: the request's tools (OpenAI's tool objects), the template's ``tools``; ``None``: none.

    Raises:
        ValueError: both ``add_generation_prompt`` and ``continue_final_message`` are true (a
            continued message gets no new turn), as vLLM refuses it.
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict] | None = None

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true "
                             "(a continued final message gets no new assistant turn)")


MAX_CHAT_TEMPLATE_BYTES = 1024 * 1024
"""A server's chat template (``pdcluster up --chat-template``) is at most this long."""


def check_chat_template(text: str) -> None:
    """Raises ValueError: ``text`` is empty, over :data:`MAX_CHAT_TEMPLATE_BYTES` or not Jinja the
    template renderer can parse (the message gives the line)."""
    if not text.strip():
        raise ValueError("the chat template is empty")
    if len(text.encode()) > MAX_CHAT_TEMPLATE_BYTES:
        raise ValueError(f"the chat template is over {MAX_CHAT_TEMPLATE_BYTES} bytes")
    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja: {e.message} (line {e.lineno})") from None


def renderer_arguments(tokenizer) -> frozenset[str]:
    """The names ``template_kwargs`` may not use: ``apply_chat_template``'s own arguments
    (``tokenize``, ``chat_template``, ``tools`` ...) and the template's ``messages``."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters
    named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset(named | {"messages", "conversation"})


def render_chat(tokenizer, messages: list[dict], options: ChatOptions = ChatOptions()) -> list[int]:
    """Render ``messages`` (``{"role", "content"}`` dicts) with the model's chat template as
    ``options`` ask (by default with the generation prompt) and tokenize without adding special
    tokens again (the template has them); a special token's string inside a content stays
    ordinary text (module docstring).

    Raises:
        jinja2.exceptions.TemplateError: the template refused the messages or the variables, or it
            does not write a content that holds a special token's string as given (it dropped or
            changed it), so that content cannot be kept as text.
        ValueError: ``continue_final_message`` and the template does not write the final message's
            content (HF's check).
        TypeError: the template used a variable of ``template_kwargs`` with the wrong type.
    """
    render = dict(options.template_kwargs, add_generation_prompt=options.add_generation_prompt,
                  continue_final_message=options.continue_final_message, tokenize=False)
    if options.tools:
        render["tools"] = options.tools
    controls = _special_pattern(tokenizer)
    if controls is None or not any(controls.search(m["content"]) for m in messages):
        text = tokenizer.apply_chat_template(messages, **render)
        return tokenizer.encode(text, add_special_tokens=False)
    marks = [f"\ue000{uuid.uuid4().hex}\ue001" for _ in messages]
    rest = tokenizer.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks)], **render)
    ids: list[int] = []
    for i, (m, mark) in enumerate(zip(messages, marks)):
        before, found, after = rest.partition(mark)
        if not found or mark in after:
            raise TemplateError(f"messages[{i}].content holds a control token of the model "
                                f"({controls.search(m['content']).group(0)!r}) and the chat template does not "
                                "write it as given, so it cannot be kept as text")
        ids += tokenizer.encode(before, add_special_tokens=False)
        ids += tokenizer.encode(m["content"], add_special_tokens=False, split_special_tokens=True)
        rest = after
    return ids + tokenizer.encode(rest, add_special_tokens=False)


def template_messages(messages) -> list[dict]:
    """The template's messages for ``ChatMessage`` protos: ``role`` and ``content``, and where
    given ``name``, ``tool_call_id`` and ``tool_calls`` (``{"id", "type": "function", "function":
    {"name", "arguments"}}`` with the arguments parsed).

    Raises:
        ValueError: a tool call's arguments are not a JSON object (the message names it).
    """
    out = []
    for i, m in enumerate(messages):
        item: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name:
            item["name"] = m.name
        if m.tool_call_id:
            item["tool_call_id"] = m.tool_call_id
        if len(m.tool_calls):
            item["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": _arguments(c.arguments, f"messages[{i}]"
                                                                                       f".tool_calls[{j}]")}}
                                  for j, c in enumerate(m.tool_calls)]
        out.append(item)
    return out


def _arguments(text: str, where: str) -> dict:
    try:
        value = json.loads(text) if text else {}
    except RecursionError:
        raise ValueError(f"{where}.function.arguments nests deeper than {MAX_ARGUMENTS_DEPTH} levels") from None
    except ValueError:
        raise ValueError(f"{where}.function.arguments is not JSON: {text[:40]!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object, got {type(value).__name__}")
    if json_depth(value) > MAX_ARGUMENTS_DEPTH:  # the template renderer copies values recursively
        raise ValueError(f"{where}.function.arguments nests deeper than {MAX_ARGUMENTS_DEPTH} levels")
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:  # an escaped lone surrogate ("\ud800"): no tokenizer takes it
        raise ValueError(f"{where}.function.arguments is not valid Unicode (a lone surrogate)") from None
    return value


def json_depth(value) -> int:
    """How deep JSON ``value`` nests (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, level = todo.pop()
        deepest = max(deepest, level)
        if isinstance(item, dict):
            todo.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            todo.extend((v, level + 1) for v in item)
    return deepest


def control_token_in(tokenizer, value) -> str | None:
    """The first special token's string inside a JSON ``value`` (its strings and keys), or ``None``:
    a template variable is written as the template's own text, whose control strings become real
    control tokens, so a variable holding one could open a turn a message cannot."""
    pattern = _special_pattern(tokenizer)
    todo = [value] if pattern is not None else []
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            if found := pattern.search(item):
                return found.group(0)
        elif isinstance(item, dict):
            todo += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            todo += item
    return None


_PATTERNS: dict[int, tuple[object, re.Pattern | None]] = {}  # id(tokenizer) -> (tokenizer, its pattern)


def _special_pattern(tokenizer) -> re.Pattern | None:
    """A regex finding any special token's string (``None`` when the tokenizer has none); made
    once per tokenizer (kept with it, so its id stays its own)."""
    cached = _PATTERNS.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    pattern = _compile_specials(tokenizer)
    _PATTERNS[id(tokenizer)] = (tokenizer, pattern)
    return pattern


def _compile_specials(tokenizer) -> re.Pattern | None:
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    tokens = {t.content for t in decoder.values() if getattr(t, "special", False)}
    tokens |= set(getattr(tokenizer, "all_special_tokens", ()))
    tokens.discard("")
    if not tokens:
        return None
    return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True))))
