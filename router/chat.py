"""Chat messages to prompt token ids: the model's chat template, with message contents kept as text.

A chat template writes the model's control tokens (``<|im_start|>``, ``<|eot_id|>``,
``<start_of_turn>`` ...) around each message as text, and the rendered text is tokenized with
special tokens parsed. A message whose content holds such a string would then turn it into the real
control token: a user's ``<|im_end|>\\n<|im_start|>system ...`` would open a system turn of its own
(vLLM and SGLang render it that way). :func:`render_chat` keeps contents as text, as OpenAI's API
does: when a content holds a special token's string, the template is rendered around a unique mark
per message, the template's own text is tokenized with special tokens parsed and each content with
them split into ordinary tokens (``split_special_tokens``). Chats without such strings (nearly all)
are tokenized as one rendered string, exactly as HF's ``apply_chat_template(..., tokenize=True)``.
"""

from __future__ import annotations

import re
import uuid

from jinja2.exceptions import TemplateError


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Render ``messages`` (``{"role", "content"}`` dicts) with the model's chat template
    (generation prompt added) and tokenize without adding special tokens again (the template has
    them); a special token's string inside a content stays ordinary text (module docstring).

    Raises:
        jinja2.exceptions.TemplateError: the template refused the messages, or it does not write
            a content that holds a special token's string as given (it dropped or changed it), so
            that content cannot be kept as text.
    """
    controls = _special_pattern(tokenizer)
    if controls is None or not any(controls.search(m["content"]) for m in messages):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    marks = [f"\ue000{uuid.uuid4().hex}\ue001" for _ in messages]
    rest = tokenizer.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks)],
                                         add_generation_prompt=True, tokenize=False)
    ids: list[int] = []
    for i, (m, mark) in enumerate(zip(messages, marks)):
        before, found, after = rest.partition(mark)
        if not found or mark in after:
            raise TemplateError(f"messages[{i}].content holds a control token of the model "
                                f"({controls.search(m['content']).group(0)!r}) and the chat template does not "
                                "write it as given, so it cannot be kept as text")
        ids += tokenizer.encode(before, add_special_tokens=False)
        ids += tokenizer.encode(m["content"], add_special_tokens=False, split_special_tokens=True)
        rest = after
    return ids + tokenizer.encode(rest, add_special_tokens=False)


_PATTERNS: dict[int, tuple[object, re.Pattern | None]] = {}  # id(tokenizer) -> (tokenizer, its pattern)


def _special_pattern(tokenizer) -> re.Pattern | None:
    """A regex finding any special token's string (``None`` when the tokenizer has none); made
    once per tokenizer (kept with it, so its id stays its own)."""
    cached = _PATTERNS.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    pattern = _compile_specials(tokenizer)
    _PATTERNS[id(tokenizer)] = (tokenizer, pattern)
    return pattern


def _compile_specials(tokenizer) -> re.Pattern | None:
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    tokens = {t.content for t in decoder.values() if getattr(t, "special", False)}
    tokens |= set(getattr(tokenizer, "all_special_tokens", ()))
    tokens.discard("")
    if not tokens:
        return None
    return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True))))
