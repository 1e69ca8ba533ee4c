"""``hermes``: calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The format of Nous Research's Hermes 2 Pro and later and of Qwen 2.5 and later, whose chat
templates write the request's tools into the system prompt (vLLM's ``hermes`` parser reads the
same). Text outside the tags is content. A block whose inside is not a JSON object with a string
``name`` (and an object ``arguments``, or none) stays content, tags included, so nothing the
model wrote is lost; a block still open at the end is read the same way.
"""

from __future__ import annotations

import json

from router.tool_parsers.base import ToolParser, call_of, until

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    markers = (START, END)

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._inside = False

    def _feed(self, text: str) -> None:
        self._buf += text
        while True:
            if not self._inside:
                before, self._buf, self._inside = until(self._buf, START)
                self._text(before)
                if not self._inside:
                    return
            else:
                at = self._buf.find(END)
                if at < 0:
                    return
                self._block(self._buf[:at], closed=True)
                self._buf, self._inside = self._buf[at + len(END):], False

    def _finish(self) -> None:
        if self._inside:
            self._block(self._buf, closed=False)
        else:
            self._text(self._buf)
        self._buf, self._inside = "", False

    def _block(self, inside: str, closed: bool) -> None:
        call = _read_call(inside)
        if call is None:
            self._text(START + inside + (END if closed else ""))
        else:
            self._call(*call)


def _read_call(text: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a call's JSON text, or ``None`` when it is not one."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return call_of(value.get("name"), value.get("arguments", {})) if isinstance(value, dict) else None
