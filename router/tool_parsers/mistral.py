"""``mistral``: Mistral's tool calls after its ``[TOOL_CALLS]`` token, in either of its forms:
``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral 7B v0.3 and its tokenizers up to v7)
or ``[TOOL_CALLS]name[ARGS]{...}`` once per call (tokenizers v11 and later), as vLLM's ``mistral``
parser reads them. Call ids are 9 letters and digits: Mistral's chat template refuses any other id
when the calls come back in the next turn.

Text before the first ``[TOOL_CALLS]`` is content; what follows is read whole at the end of the
answer. Calls that do not parse are given back as content, tag included.
"""

from __future__ import annotations

import json
import secrets
import string

from router.tool_parsers.base import ToolParser, call_of, until

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ALNUM = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """9 random letters and digits (the id Mistral's templates take)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


class MistralParser(ToolParser):
    markers = (TOOL_CALLS, ARGS)

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._inside = False

    def _feed(self, text: str) -> None:
        self._buf += text
        if not self._inside:
            before, self._buf, self._inside = until(self._buf, TOOL_CALLS)
            self._text(before)

    def _finish(self) -> None:
        if not self._inside:
            self._text(self._buf)
        else:
            calls = _read_calls(self._buf)
            if calls is None:
                self._text(TOOL_CALLS + self._buf)
            for name, arguments in calls or ():
                self._call(name, arguments, mistral_call_id())
        self._buf, self._inside = "", False


def _read_calls(text: str) -> list[tuple[str, str]] | None:
    """``(name, arguments JSON)`` per call after the first ``[TOOL_CALLS]``, or ``None``."""
    text = text.strip()
    try:
        if text.startswith("["):
            items = json.loads(text)
            if not isinstance(items, list) or not items:
                return None
            return [_call(item.get("name"), item.get("arguments", {})) for item in items]
        calls = []
        for part in text.split(TOOL_CALLS):
            name, found, arguments = part.partition(ARGS)
            if not found:
                return None
            calls.append(_call(name.strip(), json.loads(arguments)))
        return calls
    except (ValueError, AttributeError, TypeError, RecursionError):
        return None


def _call(name, arguments) -> tuple[str, str]:
    if isinstance(arguments, str):  # some checkpoints write the arguments as JSON text
        arguments = json.loads(arguments)
    call = call_of(name, arguments) if name else None
    if call is None:
        raise ValueError("not a call")
    return call
