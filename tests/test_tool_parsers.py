"""Tool-call parsers (router/tool_parsers/): every split of an answer into stream pieces reads as the whole answer;
what is no call comes back as content."""

from __future__ import annotations

import pytest

from router.tool_parsers import TOOL_PARSERS, NamedParser, RequiredParser


def _run(parser, text: str, step: int) -> tuple[str, list[tuple]]:
    """Feed ``text`` in pieces of ``step`` characters; returns the joined content and each call's (index, name,
    arguments), arguments joined over their pieces."""
    got = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    calls: dict[int, list] = {}
    for piece in (c for g in got for c in g.calls):
        entry = calls.setdefault(piece.index, [piece.index, piece.name, ""])
        assert (piece.name is None) == (entry[2] != "" or piece is not next(
            c for g in got for c in g.calls if c.index == piece.index)), "only a call's first piece names it"
        entry[2] += piece.arguments
    return "".join(g.content for g in got), [tuple(v) for _, v in sorted(calls.items())]


PARSED = [  # (parser, answer, content, calls)
    (lambda: TOOL_PARSERS["hermes"](),
     'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>{"name": "get_time"}</tool_call>\n',
     "Let me check.", [(0, "get_weather", '{"city": "Paris"}'), (1, "get_time", "{}")]),
    (lambda: TOOL_PARSERS["hermes"](), "No tools needed: 2 < 3 and <tool_ is not a tag.",
     "No tools needed: 2 < 3 and <tool_ is not a tag.", []),
    (lambda: TOOL_PARSERS["hermes"](), "a <tool_call>{not json}</tool_call> b",
     "a <tool_call>{not json}</tool_call> b", []),
    (lambda: TOOL_PARSERS["hermes"](), 'x <tool_call>{"name": "f", "arguments": {"a": [1, 2]}}',
     "x", [(0, "f", '{"a": [1, 2]}')]),
    (lambda: TOOL_PARSERS["hermes"](), " \n", " \n", []),
    (lambda: TOOL_PARSERS["llama3_json"](),
     '<|python_tag|>{"name": "f", "parameters": {"a": "é"}}; {"name": "g", "arguments": {}}',
     "", [(0, "f", '{"a": "é"}'), (1, "g", "{}")]),
    (lambda: TOOL_PARSERS["llama3_json"](), "The answer is {\"a\": 1}", "The answer is {\"a\": 1}", []),
    (lambda: TOOL_PARSERS["llama3_json"](), '{"a": 1} not a call', '{"a": 1} not a call', []),
    (lambda: TOOL_PARSERS["llama3_json"](), '{"name": "f", "parameters": {"a": ', '{"name": "f", "parameters": {"a": ', []),
    (lambda: TOOL_PARSERS["pythonic"](), "[get_weather(city='Paris', days=[1, 2], hot=True), get_time()]",
     "", [(0, "get_weather", '{"city": "Paris", "days": [1, 2], "hot": true}'), (1, "get_time", "{}")]),
    (lambda: TOOL_PARSERS["pythonic"](), "<|python_start|>[f(a=None)]<|python_end|>", "", [(0, "f", '{"a": null}')]),
    (lambda: TOOL_PARSERS["pythonic"](), "[f(__import__('os'))]", "[f(__import__('os'))]", []),
    (lambda: TOOL_PARSERS["pythonic"](), "[1, 2] are numbers", "[1, 2] are numbers", []),
    (lambda: TOOL_PARSERS["pythonic"](), "Use f(a=1).", "Use f(a=1).", []),
    (lambda: TOOL_PARSERS["mistral"](), 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g"}]',
     "Sure.", [(0, "f", '{"a": 1}'), (1, "g", "{}")]),
    (lambda: TOOL_PARSERS["mistral"](), '[TOOL_CALLS]f[ARGS]{"a": "x"}[TOOL_CALLS]g[ARGS]{}',
     "", [(0, "f", '{"a": "x"}'), (1, "g", "{}")]),
    (lambda: TOOL_PARSERS["mistral"](), "[TOOL_CALLS]not a call", "[TOOL_CALLS]not a call", []),
    (lambda: TOOL_PARSERS["mistral"](), "[TOOL_ maybe", "[TOOL_ maybe", []),
    (RequiredParser, '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]',
     "", [(0, "f", '{"a": 1}'), (1, "g", "{}")]),
    (RequiredParser, '[{"name": "f", "parameters": {"a"', '[{"name": "f", "parameters": {"a"', []),
    (RequiredParser, '[{"name": "f", "parameters": {}}, {"name": "f", "para', "", [(0, "f", "{}")]),
    (lambda: NamedParser("f"), '{"a": 1}', "", [(0, "f", '{"a": 1}')]),
    (lambda: NamedParser("f"), "", "", []),  # no text (a thinking never ended): no call
]


@pytest.mark.parametrize("make,answer,content,calls", PARSED)
def test_parsers_read_the_same_calls_whatever_the_stream_pieces(make, answer, content, calls):
    """Every split of the answer into stream pieces gives the calls and content of the whole answer; a block that
    is no call, and JSON cut short, come back as content (nothing is lost)."""
    for step in (1, 2, 3, 7, max(1, len(answer))):
        assert _run(make(), answer, step) == (content, calls), step


def test_mistral_call_ids_are_the_nine_characters_its_template_takes():
    parser = TOOL_PARSERS["mistral"]()
    got = parser.feed('[TOOL_CALLS][{"name": "f", "arguments": {}}]') + parser.finish()
    assert len(got.calls[0].id) == 9 and got.calls[0].id.isalnum()
