"""OpenAI's ``tools`` and ``tool_choice`` on ``/v1/chat/completions``, as vLLM serves them.

* The tools go to the chat template (``MessageList.tools``; a template without tool support
  ignores them, as with vLLM), whatever the choice.
* ``tool_choice`` (left out: ``"auto"`` with tools, ``"none"`` without, OpenAI's defaults):
  * ``"none"``: the answer is content;
  * a named function (``{"type": "function", "function": {"name": ...}}``): the answer is
    constrained to the function's ``parameters`` schema and returned as one call of it
    (``finish_reason`` ``stop``, as OpenAI's);
  * ``"required"``: the answer is constrained to a JSON array of one or more
    ``{"name": ..., "parameters": ...}`` calls of the given tools (at most one with
    ``parallel_tool_calls: false``), returned as ``tool_calls`` with ``finish_reason``
    ``tool_calls``; the schema is vLLM's (``anyOf`` per tool, their ``$defs`` merged);
  * ``"auto"``: the model writes calls in its family's format and the router's parser
    (``pdcluster up --tool-call-parser``, :mod:`router.tool_parsers`) reads them out; without
    a parser it is refused with 400, as vLLM refuses it without ``--enable-auto-tool-choice``.

The constraints are structured outputs (:mod:`common.structured_outputs`, compiled by the
workers), so a request cannot give ``response_format`` too with a named or required choice.
The tools' shape is checked as on the gRPC door (:mod:`router.tool_specs`: at most
:data:`router.tool_specs.MAX_TOOLS` function tools, names of 1-64 letters, digits, ``_`` and ``-``
(OpenAI's), each named once, parameters the schema of an object). With ``parallel_tool_calls:
false``, ``auto`` keeps an answer's first call only (vLLM's ``maybe_filter_parallel_tool_calls``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property

from common.structured_outputs import write_structured
from pdcluster.v1 import common_pb2
from router.tool_parsers import TOOL_PARSERS, NamedParser, RequiredParser, ToolParser
from router.tool_specs import MAX_TOOLS, check_tools

_CHOICES = ("none", "auto", "required")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolRequestError(ValueError):
    """A malformed ``tools`` / ``tool_choice``; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    """A chat request's validated tools and choice.

    Attributes:
        tools: the tool objects as given (type ``function`` each).
        choice: ``"none"``, ``"auto"``, ``"required"`` or ``"function"`` (named).
        function: the named function (``choice == "function"``).
        parallel: ``parallel_tool_calls`` (``required``: more than one call allowed).
        parser: the registered parser ``auto`` reads the answer with.
    """

    tools: list[dict]
    choice: str
    function: str | None = None
    parallel: bool = True
    parser: str | None = None

    @cached_property
    def constraint(self) -> dict | None:
        """The ``structured_outputs`` dict forcing the answer (named, required), else ``None``;
        computed once, when :func:`tool_choice` checks it.

        Raises:
            ToolRequestError: two tools define one name of ``$defs`` or ``definitions`` differently.
        """
        if self.choice == "function":
            return {"json": self._parameters()[self.function]}
        if self.choice == "required":
            return {"json": required_schema(self.tools, self.parallel)}
        return None

    def structured_outputs(self, field: str = "tools") -> common_pb2.StructuredOutputs | None:
        """:attr:`constraint` as the request's ``StructuredOutputs`` (``None``: the choice forces nothing);
        ``field`` names the tools in an error.

        Raises:
            ToolRequestError: a lone surrogate escaped in the tools' schemas (``param`` ``tools``).
        """
        if self.constraint is None:
            return None
        msg = common_pb2.StructuredOutputs()
        try:
            write_structured(msg, self.constraint, field=field)
        except TypeError as e:
            raise ToolRequestError(str(e), "tools") from None
        return msg

    def new_parser(self) -> ToolParser | None:
        """A parser for one choice's answer (``None``: the answer is plain content)."""
        if self.choice == "function":
            return NamedParser(self.function)
        if self.choice == "required":
            return RequiredParser()
        if self.choice == "auto":
            return TOOL_PARSERS[self.parser](max_calls=None if self.parallel else 1)
        return None

    @property
    def markers(self) -> tuple[str, ...]:
        """The strings ``auto``'s parser reads calls by (none for the other choices)."""
        return TOOL_PARSERS[self.parser].markers if self.choice == "auto" else ()

    def _parameters(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"].get("parameters") or _EMPTY_PARAMETERS for t in self.tools}


def tool_choice(body, parser: str | None) -> ToolChoice | None:
    """The :class:`ToolChoice` of a chat ``body`` (``None``: no tools), ``parser`` the router's.

    Raises:
        ToolRequestError: tools that are not function tools or are misnamed, more than
            :data:`MAX_TOOLS`, a ``tool_choice`` that is none of OpenAI's forms or names no given
            tool, a choice without tools, or ``auto`` while the router has no parser.
    """
    tools, choice = body.tools, body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise ToolRequestError("tool_choice needs tools: this request gives none", "tool_choice")
        return None
    _check_tools(tools)
    choice = "auto" if choice is None else choice
    function = None
    if isinstance(choice, dict):
        function = _named(choice, {t["function"]["name"] for t in tools})
        choice = "function"
    elif choice not in _CHOICES:
        got = repr(choice)
        got = got if len(got) <= 64 else f"{got[:60]}..."
        raise ToolRequestError(f"tool_choice must be one of {', '.join(map(repr, _CHOICES))} or "
                               '{"type": "function", "function": {"name": ...}}, got ' f"{got}", "tool_choice")
    if choice == "auto" and parser is None:
        raise ToolRequestError('tool_choice "auto" needs a tool call parser: this server was started without '
                               "--tool-call-parser (name a function, or use \"required\" or \"none\")", "tool_choice")
    picked = ToolChoice(list(tools), choice, function, body.parallel_tool_calls is not False, parser)
    picked.constraint  # computed (and kept) now: raises ToolRequestError where the tools' definitions collide
    return picked


def template_tools(tools: list | None) -> ToolChoice | None:
    """``tools`` for the chat template alone (vLLM's ``/tokenize``): checked, choice ``none``.

    Raises:
        ToolRequestError: as :func:`tool_choice`.
    """
    if not tools:
        return None
    _check_tools(tools)
    return ToolChoice(list(tools), "none")


def _check_tools(tools: list) -> None:
    try:
        check_tools(tools)
    except ValueError as e:
        raise ToolRequestError(str(e), "tools") from None


def _named(choice: dict, names: set[str]) -> str:
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise ToolRequestError('tool_choice must name a function as {"type": "function", "function": '
                               '{"name": ...}}', "tool_choice")
    if name not in names:
        raise ToolRequestError(f"tool_choice names function {name!r}, which is not in tools"[:200], "tool_choice")
    return name


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """The JSON schema of ``required``'s answer: an array of at least one (at most one unless
    ``parallel``) ``{"name": <a tool's name>, "parameters": <its parameters>}``, one ``anyOf``
    branch per tool; each tool's ``$defs`` and ``definitions`` move to the top so its references
    (:mod:`router.tool_specs` allows only those) still resolve (vLLM's ``_get_json_schema_from_tool``).

    Raises:
        ToolRequestError: two tools define one name of ``$defs`` or ``definitions`` differently.
    """
    defs: dict = {}
    branches = []
    for tool in tools:
        fn = tool["function"]
        params = dict(fn.get("parameters") or _EMPTY_PARAMETERS)
        for group in ("$defs", "definitions"):
            for key, value in (params.pop(group, None) or {}).items():
                if defs.setdefault(group, {}).setdefault(key, value) != value:
                    raise ToolRequestError(f"tools define {group}.{key} twice, differently"[:200], "tools")
        branches.append({"type": "object", "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                                                          "parameters": params},
                         "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update((group, values) for group, values in defs.items() if values)
    return schema


def tools_json(choice: ToolChoice | None) -> str:
    """``MessageList.tools``: the tools as JSON text (``""``: none)."""
    return json.dumps(choice.tools, ensure_ascii=False) if choice is not None else ""
