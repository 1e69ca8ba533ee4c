"""``pythonic``: calls written as a Python list of function calls with keyword arguments,
``[get_weather(city='Paris', unit='celsius'), get_time(zone='CET')]``: Llama 3.2's zero-shot tool
calling and Llama 4's (there between ``<|python_start|>`` and ``<|python_end|>``), as vLLM's
``pythonic`` parser reads it.

An answer that begins with ``[`` (after the optional tag) is held back and read whole at its end
with :func:`ast.parse` (never evaluated): each element must be a call of a plain name with keyword
arguments whose values are literals (strings, numbers, ``True``/``False``/``None``, lists and dicts
of them), written out as JSON arguments. An answer that is not such a list is content, whole.
"""

from __future__ import annotations

import ast
import json

from router.tool_parsers.base import ToolParser

START, END = "<|python_start|>", "<|python_end|>"


class PythonicParser(ToolParser):
    markers = (START, END)

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._calls_mode: bool | None = None

    def _feed(self, text: str) -> None:
        self._buf += text
        if self._calls_mode is None:
            head = self._buf.lstrip()
            if head.startswith(START):
                head = head[len(START):].lstrip()
            elif START.startswith(head):  # nothing yet, or the tag's beginning
                return
            if not head:
                return
            self._calls_mode = head.startswith("[")
        if not self._calls_mode:
            self._text(self._buf)
            self._buf = ""

    def _finish(self) -> None:
        calls = _read_calls(self._buf.strip().removeprefix(START).removesuffix(END)) if self._calls_mode else None
        if calls is None:
            self._text(self._buf)
        else:
            for name, arguments in calls:
                self._call(name, arguments)
        self._buf = ""


def _read_calls(text: str) -> list[tuple[str, str]] | None:
    """``(name, arguments JSON)`` per call of the Python list ``text``, or ``None`` when it is not one."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            if any(k.arg is None for k in node.keywords):  # **kwargs
                return None
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False)))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):  # not a list of literal calls
        return None
