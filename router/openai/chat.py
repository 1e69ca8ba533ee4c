"""OpenAI chat bodies -> the router's chat prompt (``MessageList``) and ``GenerateRequest`` messages.

Messages keep what a chat template reads: role, text content (a string, or text parts joined by
newlines), an assistant message's ``tool_calls``, a tool message's ``tool_call_id`` and a
message's ``name``. An assistant message that only calls tools may have no content (OpenAI's
``null``): the template gets ``""``, as vLLM gives it. The request's ``tools`` go to the
template too, and ``tool_choice`` decides how the answer is read (:mod:`router.tool_choice`).
"""

from __future__ import annotations

import json
from dataclasses import replace

from pdcluster.v1 import common_pb2, router_pb2
from router.answer import AnswerReading
from router.openai.protocol import ChatCompletionRequest
from router.openai.requests import (CHAT_ROUTE, ID_PREFIXES, OpenAIRequestError, SubRequest, check_utf8, expand,
                                    field_of, refuse_unsupported)
from router.tool_choice import ToolChoice, ToolRequestError, tool_choice, tools_json


def chat_prompt(request, tools: ToolChoice | None = None) -> router_pb2.MessageList:
    """The chat of ``request`` (a chat completion or a ``/tokenize`` body) with vLLM's chat
    options: ``add_generation_prompt`` (unset: true), ``continue_final_message`` and
    ``chat_template_kwargs`` (sent as JSON text; the router checks them), and ``tools``.

    Raises:
        OpenAIRequestError: as :func:`chat_text`; a template variable or tool that is not valid Unicode.
    """
    kwargs = json.dumps(request.chat_template_kwargs, ensure_ascii=False) if request.chat_template_kwargs else ""
    listed = tools_json(tools)
    check_utf8(kwargs, "chat_template_kwargs", "chat_template_kwargs")
    check_utf8(listed, "tools", "tools")
    chat = router_pb2.MessageList(messages=chat_text(request), continue_final_message=bool(request.continue_final_message),
                                  chat_template_kwargs=kwargs, tools=listed)
    if request.add_generation_prompt is not None:
        chat.add_generation_prompt = request.add_generation_prompt
    return chat


def answer_role(body) -> str:
    """The role a chat answer is given: ``assistant``, or with ``add_generation_prompt`` false the
    final message's (the model writes on in that turn), as vLLM's ``get_chat_request_role``."""
    messages = getattr(body, "messages", None)
    if not messages or getattr(body, "add_generation_prompt", None) is not False:
        return "assistant"
    return messages[-1].role


def chat_text(request: ChatCompletionRequest) -> list[common_pb2.ChatMessage]:
    """The chat messages with text content, their tool calls, call ids and names.

    Raises:
        OpenAIRequestError: a message without content (but an assistant's with tool calls), a
            content part whose type is not ``text`` (named with its index), a malformed tool call,
            or a string that is not valid Unicode (a lone surrogate).
    """
    out = []
    for i, m in enumerate(request.messages):
        check_utf8(m.role, f"messages[{i}].role", f"messages[{i}].role")
        content = m.content
        if content is None and not m.tool_calls:  # OpenAI allows it only beside tool calls
            raise OpenAIRequestError(f"messages[{i}].content: a message of role {m.role!r} needs content (a "
                                     "string or a list of text parts)", param=f"messages[{i}].content")
        texts = {"content": _text_parts(content, i) if isinstance(content, list) else content or "",
                 "tool_call_id": m.tool_call_id or "", "name": m.name or ""}
        for name, text in texts.items():  # before protobuf sees them
            check_utf8(text, f"messages[{i}].{name}", f"messages[{i}].{name}")
        out.append(common_pb2.ChatMessage(role=m.role, tool_calls=_tool_calls(m.tool_calls or [], i), **texts))
    return out


def _text_parts(content: list[dict], i: int) -> str:
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text":
            raise OpenAIRequestError(
                f"messages[{i}].content[{j}]: content part type {part.get('type')!r} is not supported "
                f"(only 'text' parts are served)", param=f"messages[{i}].content")
        if not isinstance(part.get("text"), str):
            raise OpenAIRequestError(
                f"messages[{i}].content[{j}].text: a text part needs a string 'text', got "
                f"{type(part.get('text')).__name__}", param=f"messages[{i}].content")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(calls: list[dict], i: int) -> list[common_pb2.ToolCall]:
    """An assistant message's ``tool_calls`` (``{"id", "type": "function", "function": {"name",
    "arguments"}}``, arguments as JSON text) as protos; the router checks the arguments are JSON."""
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise OpenAIRequestError(f'{where} must be {{"id": ..., "type": "function", "function": '
                                     '{"name": ..., "arguments": ...}}', param=f"messages[{i}].tool_calls")
        name, arguments, cid = fn.get("name"), fn.get("arguments", "{}"), call.get("id", "")
        if not all(isinstance(x, str) for x in (name, arguments, cid)):
            raise OpenAIRequestError(f"{where}: id, function.name and function.arguments (JSON text) must be "
                                     "strings", param=f"messages[{i}].tool_calls")
        for what, text in (("id", cid), ("function.name", name), ("function.arguments", arguments)):
            check_utf8(text, f"{where}.{what}", f"messages[{i}].tool_calls")
        out.append(common_pb2.ToolCall(id=cid, name=name, arguments=arguments))
    return out


def chat_requests(body: ChatCompletionRequest, client_id: str | None = None, tool_parser: str | None = None,
                  tokenizer=None, reasoning_parser: str | None = None) -> tuple[str, list[SubRequest]]:
    """The sub-requests of a ``/v1/chat/completions`` body (``n`` of them) and their base id
    (``chatcmpl-<client_id>`` with the client's ``X-Request-Id``, as vLLM's), each with how its
    answer is read (:class:`router.answer.AnswerReading`: the router's ``tool_parser``
    for ``tool_choice: "auto"`` and ``reasoning_parser``); where a marker they read is a special
    token of ``tokenizer``, the text keeps special tokens unless the request says otherwise.

    Raises:
        OpenAIRequestError: a non-text content part, ``n`` or ``top_logprobs`` out of shape,
            malformed tools or tool choice.
    """
    refuse_unsupported(body, served=frozenset({"tools", "tool_choice"}))
    if field_of(body, "echo") not in (None, False):
        raise OpenAIRequestError("echo is served on /v1/completions only", param="echo", code="unsupported_parameter")
    try:
        tools = tool_choice(body, tool_parser)
    except ToolRequestError as e:
        raise OpenAIRequestError(str(e), param=e.param) from None
    messages = chat_prompt(body, tools)
    top = body.top_logprobs or 0
    if top < 0:
        raise OpenAIRequestError(f"top_logprobs must be >= 0, got {top}", param="top_logprobs")
    if top and not body.logprobs:
        raise OpenAIRequestError("top_logprobs requires logprobs: true", param="top_logprobs")
    logprobs = max(top, 1) if body.logprobs else 0
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    base, subs = expand([{"messages": messages}], body, logprobs, top, max_tokens, ID_PREFIXES[CHAT_ROUTE],
                        client_id, tools)
    reading = AnswerReading(reasoning_parser, body.include_reasoning, tools)
    if tokenizer is not None and field_of(body, "skip_special_tokens") is None and reading.keeps_special_tokens(tokenizer):
        for sub in subs:
            sub.request.sampling.skip_special_tokens = False
    return base, [replace(sub, reading=reading) if reading.reads else sub for sub in subs]
