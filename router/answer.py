"""Reading a chat answer's text: reasoning first (:mod:`router.reasoning_parsers`), then tool calls in
what remains (:mod:`router.tool_choice`), one :class:`AnswerReader` per choice, fed as the text
arrives; a whole answer is one feed. The router's parsers and the request's choices make an
:class:`AnswerReading`."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.tool_choice import ToolChoice
from router.reasoning_parsers import REASONING_PARSERS
from router.tool_parsers import CallDelta


@dataclass
class Piece:
    """What one feed found: reasoning text, content text and pieces of tool calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __add__(self, other: Piece) -> Piece:
        return Piece(self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls)


@dataclass(frozen=True)
class AnswerReading:
    """How a chat request's answers are read.

    Attributes:
        reasoning: the router's reasoning parser (``None``: no ``reasoning_content``).
        include_reasoning: vLLM's request field: false drops the reasoning (still split off).
        tools: the request's tool choice (``None``: no tools).
    """

    reasoning: str | None = None
    include_reasoning: bool = True
    tools: ToolChoice | None = None

    @property
    def reads(self) -> bool:
        """Whether anything is read out of the text (else it is all content)."""
        return self.reasoning is not None or (self.tools is not None and self.tools.choice != "none")

    def keeps_special_tokens(self, tokenizer) -> bool:
        """Whether a marker the parsers read is a special token of ``tokenizer`` (dropped from text
        unless the request keeps special tokens, as vLLM's parsers' ``adjust_request`` sets it)."""
        specials = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
        markers = REASONING_PARSERS[self.reasoning].markers if self.reasoning else ()
        markers += self.tools.markers if self.tools is not None else ()
        return any(m in specials for m in markers)


class AnswerReader:
    """One choice's reader (:meth:`feed` each text piece, :meth:`finish` at its end)."""

    def __init__(self, reading: AnswerReading) -> None:
        self.reading = reading
        self._think = REASONING_PARSERS[reading.reasoning]() if reading.reasoning else None
        self._tools = reading.tools.new_parser() if reading.tools is not None else None

    @property
    def called(self) -> bool:
        return self._tools is not None and self._tools.called

    def feed(self, text: str) -> Piece:
        reasoning, content = self._think.feed(text) if self._think is not None else ("", text)
        return self._split(reasoning, content, last=False)

    def finish(self) -> Piece:
        reasoning, content = self._think.finish() if self._think is not None else ("", "")
        return self._split(reasoning, content, last=True)

    def _split(self, reasoning: str, content: str, last: bool) -> Piece:
        piece = Piece(reasoning if self.reading.include_reasoning else "")
        if self._tools is None:
            piece.content = content
            return piece
        got = self._tools.feed(content)
        if last:
            got += self._tools.finish()
        piece.content, piece.calls = got.content, got.calls
        return piece

    def finish_reason(self, finish: str | None) -> str | None:
        """``tool_calls`` where the model ended its turn after calling tools it chose (OpenAI's;
        a named choice ends with ``stop``)."""
        named = self.reading.tools is not None and self.reading.tools.choice == "function"
        return "tool_calls" if finish == "stop" and self.called and not named else finish
