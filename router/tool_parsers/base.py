"""What every tool-call parser shares: the deltas it returns and the rule for the text around calls.

A parser reads one choice's answer as it is generated (:meth:`ToolParser.feed` with each text
delta, :meth:`ToolParser.finish` at the end) and splits it into content and tool calls. A
non-streamed answer is the same calls on the whole text at once, so a stream and a whole answer
of the same tokens carry the same calls and, joined, the same content.

Whitespace at the end of the content so far is held back until more text comes: a model that writes
a newline before a call, between two calls or after its last one gives none of it as content
(an answer of calls alone has content ``None``, as vLLM's parsers give it), while the whitespace of an
answer without calls reaches the client unchanged at the end.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


def call_id() -> str:
    """A new tool call id (``chatcmpl-tool-<32 hex digits>``, vLLM's form)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class CallDelta:
    """A piece of tool call ``index`` (0, 1, ... in the order the calls begin): its first piece
    carries ``id`` and ``name``, every piece a part of its ``arguments`` (JSON text, whole once
    every piece is joined)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict:
        """The delta as an entry of a stream chunk's ``delta.tool_calls`` (OpenAI's shape)."""
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        function = {"arguments": self.arguments}
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


@dataclass
class Parsed:
    """What one :meth:`ToolParser.feed` or :meth:`ToolParser.finish` call found: new content text
    and new pieces of tool calls."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __add__(self, other: Parsed) -> Parsed:
        return Parsed(self.content + other.content, self.calls + other.calls)


class ToolParser(ABC):
    """Base of the parsers: subclasses implement :meth:`_feed` and may extend :meth:`_finish`,
    calling :meth:`_text` for content and :meth:`_call` for a whole call; ``_buf`` holds the text
    read and not yet given out.

    Attributes:
        max_calls: calls kept at most (later ones are dropped); ``None``: all.
        calls: how many calls began so far.
    """

    #: Strings that mark a call in the model's output; where the tokenizer has one as a special
    #: token, the request keeps special tokens in its text (vLLM's ``adjust_request``).
    markers: tuple[str, ...] = ()

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.calls = 0
        self._blank = ""  # whitespace content held back (module docstring)
        self._buf = ""
        self._out = Parsed()

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> Parsed:
        """Read the next ``text`` of the answer; returns the content and call pieces it completes."""
        self._feed(text)
        return self._take()

    def finish(self) -> Parsed:
        """The answer ended: returns what was held back (a call that never closed is read as far as
        it is whole JSON, else given back as content)."""
        self._finish()
        if self._blank and not self.called:
            self._out.content += self._blank
        self._blank = ""
        return self._take()

    @abstractmethod
    def _feed(self, text: str) -> None:
        """Read ``text``: give out what it completes through :meth:`_text` and :meth:`_call`."""

    def _finish(self) -> None:
        pass

    def _text(self, text: str) -> None:
        body = text.rstrip()
        if body:
            self._out.content += self._blank + body
            self._blank = ""
        self._blank += text[len(body):]

    def _call(self, name: str, arguments: str, cid: str | None = None) -> None:
        self._blank = ""
        if self.max_calls is not None and self.calls >= self.max_calls:
            return  # parallel_tool_calls false: the first call only (vLLM's maybe_filter_parallel_tool_calls)
        self._out.calls.append(CallDelta(self.calls, arguments, cid or call_id(), name))
        self.calls += 1

    def _take(self) -> Parsed:
        out, self._out = self._out, Parsed()
        return out


def call_of(name, arguments) -> tuple[str, str] | None:
    """``(name, arguments as JSON text)`` of a call a model wrote, or ``None`` unless ``name`` is a
    string and ``arguments`` an object."""
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def until(text: str, marker: str) -> tuple[str, str, bool]:
    """``text`` split at the first ``marker``: ``(before, after, True)``; without one, ``(what can go
    out, the end that could begin marker, False)``, so a marker split over two pieces is still found."""
    at = text.find(marker)
    if at >= 0:
        return text[:at], text[at + len(marker):], True
    keep = pending_prefix(text, marker)
    return text[:len(text) - keep], text[len(text) - keep:], False


def pending_prefix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker`` (to hold back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
