"""Tool-call parsers, chosen by name (``pdcluster up --tool-call-parser NAME``, vLLM's flag).

A model family writes its tool calls in its own format; the parser named for the served model
turns an answer into OpenAI's ``tool_calls`` when a request lets the model choose
(``tool_choice: "auto"``). Registered: ``hermes`` (:mod:`router.tool_parsers.hermes`),
``llama3_json`` (:mod:`router.tool_parsers.json_calls`), ``mistral``
(:mod:`router.tool_parsers.mistral`) and ``pythonic`` (:mod:`router.tool_parsers.pythonic`). A named or ``required`` tool choice
needs no parser: the answer is constrained to JSON and read by
:class:`router.tool_parsers.json_calls.NamedParser` / :class:`~router.tool_parsers.json_calls.RequiredParser`.
"""

from __future__ import annotations

from router.tool_parsers.base import CallDelta, Parsed, ToolParser
from router.tool_parsers.hermes import HermesParser
from router.tool_parsers.json_calls import Llama3JsonParser, NamedParser, RequiredParser
from router.tool_parsers.mistral import MistralParser
from router.tool_parsers.pythonic import PythonicParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                             "mistral": MistralParser, "pythonic": PythonicParser}


def check_tool_parser(name: str | None) -> None:
    """Raises ValueError: ``name`` is not a registered parser (the message lists them)."""
    if name is not None and name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; registered: {', '.join(sorted(TOOL_PARSERS))}")


__all__ = ["TOOL_PARSERS", "CallDelta", "NamedParser", "Parsed", "RequiredParser", "ToolParser", "check_tool_parser"]
