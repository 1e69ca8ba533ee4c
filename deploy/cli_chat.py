"""``pdcluster up``'s chat flags: the chat template the router renders with, the reasoning and tool-call parsers.

``--chat-template`` is vLLM's: a Jinja file (or a template in one line) that replaces the
model's own, e.g. one that writes the request's tools into the prompt for a model whose template
ignores them. It is read when ``up`` runs and travels with the router's config, so the router
needs no access to the file on the node it runs on.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from router.chat import MAX_CHAT_TEMPLATE_BYTES, check_chat_template
from router.reasoning_parsers import REASONING_PARSERS
from router.tool_parsers import TOOL_PARSERS


def chat_template_arg(value: str) -> str:
    """argparse type: ``--chat-template``, a file's text or, where ``value`` is no file and looks like
    Jinja (``{{`` or ``{%``), the template itself; checked by :func:`router.chat.check_chat_template`."""
    path = Path(value).expanduser()
    if path.is_file():
        if path.stat().st_size > MAX_CHAT_TEMPLATE_BYTES:
            raise argparse.ArgumentTypeError(f"{value}: over {MAX_CHAT_TEMPLATE_BYTES} bytes")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise argparse.ArgumentTypeError(f"{value}: {e}") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise argparse.ArgumentTypeError(f"{value}: no such file (give a Jinja file, or a template in one line)")
    try:
        check_chat_template(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{value}: {e}") from None
    return text


def add_chat_flags(p: argparse.ArgumentParser) -> None:
    """``--chat-template``, ``--reasoning-parser`` and ``--tool-call-parser`` (vLLM's flags)."""
    p.add_argument("--chat-template", type=chat_template_arg, default=None, metavar="PATH",
                   help="a Jinja chat template file (or a template in one line) the router renders chats with "
                        "instead of the model's own (vLLM's flag); default: the model's")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None, metavar="NAME",
                   help="how the served model marks its thinking, split off into reasoning_content (vLLM's flag; one "
                        f"of {', '.join(sorted(REASONING_PARSERS))}); default: none, thinking stays in content")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None, metavar="NAME",
                   help="how the served model writes tool calls, read out of answers with tool_choice \"auto\" "
                        f"(vLLM's flag; one of {', '.join(sorted(TOOL_PARSERS))}); default: none, auto refused")
