"""Tool calls and reasoning on the gRPC door (:mod:`router.grpc_answers`): a chat request's
``tool_choice`` becomes its constraint and its reading; each streamed ``GenerateResponse`` is split
into text, ``reasoning_text`` and ``tool_calls`` as the HTTP door splits an answer; the Python client
sends the options and folds the pieces back. End to end on a real cluster: ``tests/test_tool_calling.py``."""

from __future__ import annotations

import json

import grpc
import pytest

from pdcluster.client import ToolCall, accumulate, build_request
from pdcluster.v1 import common_pb2, router_pb2
from router.errors import RouterError
from router.grpc_answers import GrpcReading, forced_choice_error, read_responses
from router.validation import InvalidRequest

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def _chat(structured=None, **options) -> router_pb2.GenerateRequest:
    return build_request(MESSAGES, chat_options=options, structured_outputs=structured, max_tokens=8)


@pytest.fixture(scope="module")
def readings(tokenizer):
    return {"hermes": GrpcReading("hermes", "qwen3", tokenizer), "none": GrpcReading(None, None, tokenizer)}


def test_a_forced_choice_becomes_the_constraint_and_auto_needs_a_parser(readings):
    named = _chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert readings["none"].prepare(named).tools.choice == "function"
    assert json.loads(named.structured_outputs.json) == WEATHER["function"]["parameters"]
    required = _chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert readings["none"].prepare(required).tools.choice == "required"
    assert json.loads(required.structured_outputs.json)["maxItems"] == 1
    assert readings["hermes"].prepare(_chat(tools=[WEATHER])).tools.choice == "auto"  # the default with a parser
    assert readings["none"].prepare(_chat(tools=[WEATHER])) is None  # without one: the answer is text
    assert readings["none"].prepare(build_request("Weather?", max_tokens=4)) is None  # not a chat
    plain = _chat(include_reasoning=False)
    assert readings["hermes"].prepare(plain).include_reasoning is False and not plain.HasField("structured_outputs")


@pytest.mark.parametrize("options,structured,message", [
    ({"tools": [WEATHER], "tool_choice": "auto"}, None, 'messages.tool_choice "auto" needs a tool call parser'),
    ({"tool_choice": "required"}, None, "messages.tool_choice needs messages.tools"),
    ({"tools": [WEATHER], "tool_choice": "maybe"}, None, "messages.tool_choice must be one of"),
    ({"tools": [WEATHER], "tool_choice": '{"type": "function"'}, None, "messages.tool_choice is not valid JSON"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None,
     "messages.tool_choice names function 'nope', which is not in tools"),
    ({"tools": [WEATHER], "tool_choice": "required"}, {"regex": "a"}, "give structured_outputs or a named or required"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, None, r"^messages\.tools\[0\]"),
    ({"tools": [WEATHER], "tool_choice": '{"a":' * 3000 + "1" + "}" * 3000}, None,  # helper 19: was UNKNOWN
     "messages.tool_choice is not valid JSON: maximum recursion depth"),
    ({"tools": [WEATHER], "tool_choice": "a" * 20000}, None, r"got 'a{59}\.\.\.$"),  # clipped: the status stays small
])
def test_malformed_choices_are_refused_naming_the_field(readings, options, structured, message):
    with pytest.raises(InvalidRequest, match=message):
        readings["none"].prepare(_chat(structured, **options))


def test_an_escaped_lone_surrogate_in_a_forced_choices_schema_is_refused(readings):
    req = _chat(tool_choice="required")
    req.messages.tools = ('[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
                          '"properties": {"a": {"enum": ["\\ud800"]}}}}}]')  # JSON's escape: valid UTF-8 on the wire
    with pytest.raises(InvalidRequest, match="messages.tools is not valid Unicode"):
        readings["none"].prepare(req)


def _stream(texts: list[str], finish=common_pb2.FINISH_REASON_STOP) -> list[router_pb2.GenerateResponse]:
    out = [router_pb2.GenerateResponse(request_id="r", token_ids=[i], text=t) for i, t in enumerate(texts)]
    out[-1].finish_reason = finish
    return out


@pytest.mark.parametrize("cut", [1, 3, 7, 1000])
def test_the_stream_is_split_into_text_reasoning_and_calls_at_any_cut(readings, cut):
    answer = '<think>Paris, then.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    reading = readings["hermes"].prepare(_chat(tools=[WEATHER]))
    pieces = [answer[i:i + cut] for i in range(0, len(answer), cut)]
    got = accumulate(read_responses(_stream(pieces), reading))
    assert (got.reasoning_text, got.text.strip(), got.finish_reason) == ("Paris, then.", "", "TOOL_CALLS")
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert got.tool_calls[0].id and got.token_ids == list(range(len(pieces)))
    plain = accumulate(read_responses(_stream(["<think>a</think>", "Sunny", "."], common_pb2.FINISH_REASON_LENGTH),
                                      reading))
    assert (plain.reasoning_text, plain.text, plain.finish_reason, plain.tool_calls) == ("a", "Sunny.", "LENGTH", [])


def test_a_named_call_streams_its_arguments_and_ends_with_stop(readings):
    reading = readings["none"].prepare(_chat(tools=[WEATHER], tool_choice={"type": "function",
                                                                           "function": {"name": "get_weather"}}))
    got = accumulate(read_responses(_stream(['{"city": ', '"Oslo"}']), reading))
    assert (got.text, got.finish_reason) == ("", "STOP")
    assert got.tool_calls == [ToolCall(got.tool_calls[0].id, "get_weather", '{"city": "Oslo"}')]


def test_a_forced_choice_whose_schema_does_not_compile_names_the_tools(readings):
    """The workers name the constraint ``structured_outputs.json``; the client sent tools (helper 19)."""
    worker = RouterError(grpc.StatusCode.INVALID_ARGUMENT, "structured_outputs.json does not compile: bad regex")
    forced = readings["none"].prepare(_chat(tools=[WEATHER], tool_choice="required"))
    assert forced_choice_error(worker, forced).message == \
        "messages.tools (the schema the tool choice constrains the answer to) does not compile: bad regex"
    own = _chat(structured={"regex": "(("}, include_reasoning=False)
    assert forced_choice_error(worker, readings["hermes"].prepare(own)) is worker  # the client's own constraint
