"""Reasoning parsers, chosen by name (``pdcluster up --reasoning-parser NAME``, vLLM's flag).

A reasoning model thinks before it answers, between ``<think>`` and ``</think>``; the parser
named for the served model splits a chat answer into ``reasoning_content`` (the thinking, as
vLLM and DeepSeek's API name it) and ``content`` (the answer, which a tool parser then reads).
Registered:

* ``qwen3`` (Qwen3, QwQ): the thinking is the text between a leading ``<think>`` and ``</think>``;
  an answer that does not begin with ``<think>`` is content (Qwen3 with ``enable_thinking: false``:
  its template closes an empty thinking block in the prompt);
* ``deepseek_r1`` (DeepSeek-R1 and its distillations): the template opens the thinking in the
  prompt, so everything up to ``</think>`` is thinking (a leading ``<think>`` is dropped); an
  answer that never closes it is all thinking, with no content (vLLM's reading).

Read as text arrives (:meth:`ThinkParser.feed`): a possible beginning of a tag at the end of the
text is held back until it is known, so a stream and a whole answer split alike.
"""

from __future__ import annotations

from router.tool_parsers.base import until

START, END = "<think>", "</think>"


class ThinkParser:
    """Splits one answer into (reasoning, content) pieces; ``implicit_start``: the thinking is open
    from the first character (``deepseek_r1``)."""

    markers = (START, END)
    implicit_start = False

    def __init__(self) -> None:
        self._buf = ""
        self._state = "undecided"  # then "reasoning", then "content"

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content that ``text`` (the next piece of the answer) completes."""
        self._buf += text
        reasoning = content = ""
        if self._state == "undecided":
            head = self._buf.lstrip()
            if head.startswith(START):
                self._buf, self._state = head[len(START):], "reasoning"
            elif not head or START.startswith(head):
                return "", ""  # whitespace, or the tag's beginning: not known yet
            else:
                self._state = "reasoning" if self.implicit_start else "content"
        if self._state == "reasoning":
            reasoning, self._buf, ended = until(self._buf, END)
            if not ended:
                return reasoning, ""
            self._state = "content"
        content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back when the answer ended: an unclosed thinking's tail is reasoning,
        an undecided beginning content (thinking for ``implicit_start``)."""
        rest, self._buf = self._buf, ""
        if self._state == "reasoning" or (self._state == "undecided" and self.implicit_start and rest.strip()):
            return rest, ""
        return "", rest


class DeepSeekR1Parser(ThinkParser):
    implicit_start = True


REASONING_PARSERS: dict[str, type[ThinkParser]] = {"qwen3": ThinkParser, "deepseek_r1": DeepSeekR1Parser}


def check_reasoning_parser(name: str | None) -> None:
    """Raises ValueError: ``name`` is not a registered parser (the message lists them)."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; registered: {', '.join(sorted(REASONING_PARSERS))}")
