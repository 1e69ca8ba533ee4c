"""Tool calls and reasoning on the gRPC door, read as the HTTP door reads them (:mod:`router.answer`).

In: a chat request's ``MessageList.tool_choice``, ``parallel_tool_calls`` and ``include_reasoning``
(OpenAI's and vLLM's fields, :mod:`router.tool_choice`). A named or ``required`` choice becomes the
request's structured output, as on ``/v1/chat/completions``. Out: each ``GenerateResponse``'s text
split into ``text`` (the answer's content), ``reasoning_text`` (with the router's reasoning parser)
and ``tool_calls`` pieces; ``FINISH_REASON_TOOL_CALLS`` where the model ended its turn after calls it
chose. Only chat requests are read; a request the router has nothing to read for streams as is.

Defaults differ from HTTP's in one place: with tools and no ``tool_choice``, a router without a tool
call parser answers with text (``"none"``) instead of refusing, so gRPC clients that sent tools to
the chat template before this door read calls keep their answers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import grpc

from pdcluster.v1 import common_pb2, router_pb2
from router.answer import AnswerReader, AnswerReading
from router.errors import RouterError
from router.tool_choice import ToolChoice, ToolRequestError, tool_choice
from router.validation import InvalidRequest, parse_tools

_CONSTRAINT = "structured_outputs.json"  # how the workers name a constraint's schema


@dataclass(frozen=True)
class GrpcReading:
    """The router's parsers, for the gRPC door.

    Attributes:
        tool_parser: the registered tool call parser (``pdcluster up --tool-call-parser``), or None.
        reasoning_parser: the registered reasoning parser, or None.
        tokenizer: the served model's HF tokenizer.
    """

    tool_parser: str | None
    reasoning_parser: str | None
    tokenizer: Any

    def prepare(self, request: router_pb2.GenerateRequest) -> AnswerReading | None:
        """How ``request``'s answer is read (None: its text as is). Sets a named or required tool
        choice's constraint as its ``structured_outputs``, and keeps special tokens in its text where
        a marker the parsers read is one (unless the request says otherwise).

        Raises:
            InvalidRequest: malformed ``messages.tools`` or ``messages.tool_choice``, a choice without
                tools, ``auto`` on a router without a tool call parser, or a forced choice together
                with ``structured_outputs``; the message names the field.
        """
        if request.WhichOneof("prompt") != "messages":
            return None
        chat = request.messages
        choice = self._choice(chat)
        if choice is not None and choice.constraint is not None:
            if request.HasField("structured_outputs"):
                raise InvalidRequest("give structured_outputs or a named or required messages.tool_choice, not both")
            try:
                request.structured_outputs.CopyFrom(choice.structured_outputs("messages.tools"))
            except ToolRequestError as e:  # a lone surrogate escaped in the tools' schemas
                raise InvalidRequest(str(e)) from None
        include = chat.include_reasoning if chat.HasField("include_reasoning") else True
        reading = AnswerReading(self.reasoning_parser, include, choice)
        if not reading.reads:
            return None
        if not request.sampling.HasField("skip_special_tokens") and reading.keeps_special_tokens(self.tokenizer):
            request.sampling.skip_special_tokens = False
        return reading

    def _choice(self, chat: router_pb2.MessageList) -> ToolChoice | None:
        text = chat.tool_choice
        if not chat.tools:
            if text not in ("", "none"):
                raise InvalidRequest("messages.tool_choice needs messages.tools: this request gives none")
            return None
        try:
            tools = parse_tools(chat.tools, self.tokenizer)
        except InvalidRequest as e:
            raise InvalidRequest(f"messages.{e}") from None
        if text.startswith("{"):
            try:
                choice: Any = json.loads(text)
            except (ValueError, RecursionError) as e:
                raise InvalidRequest(f"messages.tool_choice is not valid JSON: {str(e)[:80]}") from None
        else:
            choice = text or (None if self.tool_parser else "none")
        parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else None
        body = SimpleNamespace(tools=tools or [], tool_choice=choice, parallel_tool_calls=parallel)
        try:
            return tool_choice(body, self.tool_parser)
        except ToolRequestError as e:
            raise InvalidRequest(f"messages.{e}") from None


def forced_choice_error(error: RouterError, reading: AnswerReading | None) -> RouterError:
    """``error`` as the client should read it: where the workers refused the constraint of a named or
    required tool choice, it names the tools that constraint came from (as the HTTP door names them)."""
    forced = reading is not None and reading.tools is not None and reading.tools.constraint is not None
    if not forced or error.code != grpc.StatusCode.INVALID_ARGUMENT or not error.message.startswith(_CONSTRAINT):
        return error
    rest = error.message[len(_CONSTRAINT):]
    return RouterError(error.code, f"messages.tools (the schema the tool choice constrains the answer to){rest}")


def read_responses(responses: Iterable[router_pb2.GenerateResponse],
                   reading: AnswerReading) -> Iterator[router_pb2.GenerateResponse]:
    """``responses`` (one request's stream) with each text split by one :class:`AnswerReader`: what it
    holds back (a tag's possible beginning) comes in a later message, the rest with the last one."""
    reader = AnswerReader(reading)
    for resp in responses:
        piece = reader.feed(resp.text)
        if resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            piece += reader.finish()
            stopped = "stop" if resp.finish_reason == common_pb2.FINISH_REASON_STOP else None
            if stopped and reader.finish_reason(stopped) == "tool_calls":
                resp.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS
        resp.text, resp.reasoning_text = piece.content, piece.reasoning
        resp.tool_calls.extend(router_pb2.ToolCallDelta(index=c.index, id=c.id or "", name=c.name or "",
                                                        arguments=c.arguments) for c in piece.calls)
        yield resp
