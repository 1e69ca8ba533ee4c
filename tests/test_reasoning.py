"""Reasoning parsers (router/reasoning_parsers.py) and the chat answer reader that chains them with tool parsers
(router/answer.py): a stream split anywhere reads as the whole answer."""

from __future__ import annotations

import pytest

from router.answer import AnswerReader, AnswerReading
from router.openai.chat import chat_requests
from router.openai.protocol import ChatCompletionRequest
from router.reasoning_parsers import REASONING_PARSERS, check_reasoning_parser

CASES = [  # (parser, answer, reasoning, content)
    ("qwen3", "<think>\nFirst, 2+2.\n</think>\n\nIt is 4.", "\nFirst, 2+2.\n", "\n\nIt is 4."),
    ("qwen3", "It is 4.", "", "It is 4."),
    ("qwen3", "  <think>cut short", "cut short", ""),
    ("qwen3", "<thin", "", "<thin"),
    ("qwen3", "a </think> b", "", "a </think> b"),
    ("deepseek_r1", "Adding.</think>4", "Adding.", "4"),
    ("deepseek_r1", "<think>Adding.</think>4", "Adding.", "4"),
    ("deepseek_r1", "never closed", "never closed", ""),
    ("deepseek_r1", "", "", ""),
]


@pytest.mark.parametrize("name,answer,reasoning,content", CASES)
def test_reasoning_splits_alike_whatever_the_stream_pieces(name, answer, reasoning, content):
    for step in (1, 2, 3, 5, max(1, len(answer))):
        parser = REASONING_PARSERS[name]()
        pieces = [parser.feed(answer[i:i + step]) for i in range(0, len(answer), step)] + [parser.finish()]
        assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == (reasoning, content), step


def test_the_reader_reads_calls_in_the_content_after_the_reasoning():
    """Thinking that mentions a call's tag is reasoning, not a call; the answer's call is read; include_reasoning
    false drops the reasoning; an unknown parser is refused with the registered names."""
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]})
    _, [sub] = chat_requests(body, tool_parser="hermes", reasoning_parser="qwen3")
    answer = '<think>I could write <tool_call> here.</think>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    for step in (1, 4, len(answer)):
        reader = AnswerReader(sub.reading)
        pieces = [reader.feed(answer[i:i + step]) for i in range(0, len(answer), step)] + [reader.finish()]
        got = pieces[0]
        for piece in pieces[1:]:
            got += piece
        assert got.reasoning == "I could write <tool_call> here." and got.content == ""
        assert [(c.name, c.arguments) for c in got.calls] == [("f", "{}")] and reader.finish_reason("stop") == "tool_calls"
    quiet = AnswerReader(AnswerReading("qwen3", include_reasoning=False))
    assert (quiet.feed("<think>x</think>y") + quiet.finish()).reasoning == ""
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'; registered: deepseek_r1, qwen3"):
        check_reasoning_parser("r1")
