"""Parsers of answers that are JSON calls from their first character.

* ``llama3_json``: Llama 3.1-3.3's JSON tool calling: the answer is ``{"name": ...,
  "parameters": {...}}`` (``arguments`` taken too), optionally after ``<|python_tag|>``, several
  separated by ``;`` (vLLM's ``llama3_json`` parser reads the same). An answer that does not begin
  with ``{`` or the tag is content.
* :class:`RequiredParser`: ``tool_choice: "required"``, the answer constrained to a JSON array of
  ``{"name": ..., "parameters": {...}}`` (:func:`router.tool_choice.required_schema`).
* :class:`NamedParser`: ``tool_choice`` naming a function: the whole answer is that function's
  arguments (constrained to its parameters' schema), streamed as they come.

Each call goes out once its JSON object is whole; where the JSON never becomes calls (cut by
``max_tokens``, not a call), the answer is given back as content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
from abc import abstractmethod

from router.tool_parsers.base import CallDelta, ToolParser, call_of

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class _JsonSequence(ToolParser):
    """Calls as whole JSON objects, read one after another from a buffer; ``_skip`` is the
    separators allowed between them."""

    _skip = " \t\r\n"

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._all = ""  # the whole answer, given back as content when it held no call
        self._calls_mode: bool | None = None  # None: undecided yet
        self._stuck = False  # a JSON value that is no call: read no further, the rest is content

    def _feed(self, text: str) -> None:
        self._all += text
        self._buf += text
        if self._calls_mode is None:
            self._calls_mode = self._decide()
            if self._calls_mode is None:
                return
        if not self._calls_mode:
            self._text(self._buf)
            self._buf = ""
            return
        if not self._stuck:
            self._read_objects()

    @abstractmethod
    def _decide(self) -> bool | None:
        """Whether the answer so far is calls (``None``: not known yet)."""

    def _read_objects(self) -> None:
        while True:
            rest = self._buf.lstrip(self._skip)
            try:
                value, end = _DECODER.raw_decode(rest)
            except (ValueError, RecursionError):
                self._buf = rest
                return
            call = self._as_call(value)
            if call is None:  # valid JSON, not a call: the rest is content
                self._buf, self._stuck = rest, True
                return
            self._call(*call)
            self._buf = rest[end:]

    @abstractmethod
    def _as_call(self, value) -> tuple[str, str] | None:
        """``(name, arguments JSON)`` of a JSON value, or ``None`` when it is no call."""

    def _finish(self) -> None:
        if self.called:  # what follows the last call
            self._text(self._buf.strip(self._skip))
        else:  # undecided: all of it is in the buffer; calls that never came: nothing went out yet
            self._text(self._all if self._calls_mode else self._buf)
        self._buf = ""


class Llama3JsonParser(_JsonSequence):
    markers = (PYTHON_TAG,)
    _skip = " \t\r\n;"

    def _decide(self) -> bool | None:
        head = self._buf.lstrip()
        if not head:
            return None
        if head.startswith(PYTHON_TAG) or head.startswith("{"):
            self._buf = head.removeprefix(PYTHON_TAG)
            return True
        return None if PYTHON_TAG.startswith(head) else False

    def _as_call(self, value) -> tuple[str, str] | None:
        if not isinstance(value, dict):
            return None
        return call_of(value.get("name"), value.get("parameters", value.get("arguments", {})))


class RequiredParser(_JsonSequence):
    """The elements of a JSON array, each ``{"name": ..., "parameters": {...}}``. The array is the
    grammar's, so what follows the last whole call can only be a call cut by ``max_tokens`` (the
    choice ends with ``length``): it is dropped, not given as content; without any whole call the
    text is the content."""

    _skip = " \t\r\n,"

    def _finish(self) -> None:
        if self.called:
            self._buf = ""
        super()._finish()

    def _decide(self) -> bool | None:
        head = self._buf.lstrip()
        if not head:
            return None
        if head.startswith("["):
            self._buf = head[1:]
            return True
        return False

    def _read_objects(self) -> None:
        super()._read_objects()
        if self._buf.lstrip(self._skip).startswith("]"):
            self._buf = self._buf.lstrip(self._skip)[1:]

    def _as_call(self, value) -> tuple[str, str] | None:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        return value["name"], json.dumps(value.get("parameters", {}), ensure_ascii=False)


class NamedParser(ToolParser):
    """One call of function ``name`` whose arguments are the whole answer (OpenAI's named
    ``tool_choice``): each text delta is a piece of its arguments. An answer with no text (a
    reasoning model that never ended its thinking) makes no call: empty arguments are no JSON."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def _feed(self, text: str) -> None:
        if not text:
            return
        if not self.called:
            self._call(self._name, text)
        else:
            self._out.calls.append(CallDelta(0, text))
