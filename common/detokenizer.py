"""Streaming detokenization and stop-string matching for one request.

:class:`IncrementalDetokenizer` turns generated token ids into text deltas with
vLLM's prefix/read-offset algorithm (``vllm/transformers_utils/detokenizer_utils.py``,
``detokenize_incrementally``): each step decodes only a short window of ids
around the new ones, so cost per token is constant, and text whose last
character is the replacement character U+FFFD (an unfinished multi-byte UTF-8
sequence split across byte-level BPE tokens) is held back until the next
token completes it.

:class:`StopStringMatcher` cuts that text stream before the first stop string,
holding back only a tail that could still grow into one.
"""

from __future__ import annotations

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt ids kept as left
# context so the first output token decodes as it would inside the sequence.
_CONTEXT_IDS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Incremental decoder of one request's output ids into text deltas.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode(ids, skip_special_tokens=...)``).
        prompt_token_ids: the request's prompt ids; its last few ids are used
            as left context only and never appear in the output text.
        skip_special_tokens: drop special tokens (EOS, chat markers) from the text.

    Invariant (byte-level BPE tokenizers such as SmolLM2/Llama-3/Qwen2, whose
    decode does no clean-up of spaces): ``"".join(deltas) + finish()`` equals
    ``tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)``.
    If the prompt context ends inside a multi-byte character it is dropped, so
    the invariant holds then too.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_IDS:])
        if self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []
        self._ids: list[int] = context
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text_parts: list[str] = []

    @property
    def output_token_ids(self) -> list[int]:
        """All output ids added so far (prompt context excluded)."""
        return self._ids[self._num_context :]

    @property
    def text(self) -> str:
        """All output text emitted so far (the concatenation of the returned deltas)."""
        return "".join(self._text_parts)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def _advance(self, flush: bool) -> str:
        """Emit text past the read offset; hold it while it ends mid-character unless ``flush``."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (not flush and new_text.endswith(_REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text_parts.append(delta)
        return delta

    def add(self, token_ids: list[int]) -> str:
        """Append newly generated ids; return the text they complete ("" if none yet).

        Ids outside the tokenizer's vocabulary decode to nothing.
        """
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        return self._advance(flush=False)

    def finish(self) -> str:
        """Return any held text (e.g. a trailing incomplete character, as U+FFFD) at end of generation."""
        return self._advance(flush=True)


class StopStringMatcher:
    """Cuts a streamed text at the first stop string.

    The first stop is the occurrence that is complete earliest in the text
    (smallest end index; on a tie the longer string, which starts earlier).
    This is where token-by-token generation stops, and it does not depend on
    how the text is split into deltas. Concatenated emits (plus :meth:`flush`
    when generation ends otherwise) equal the whole text cut before that
    occurrence, and never contain a stop string.

    Args:
        stops: stop strings; may be empty (then text passes straight through).
        include: keep the matched stop string (the text is cut after it instead: vLLM's
            ``include_stop_str_in_output``).

    Raises:
        ValueError: a stop string is empty.
    """

    def __init__(self, stops: list[str], include: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = sorted(set(stops), key=len, reverse=True)
        self._include = include
        self._held = ""
        self._context = 0  # leading characters of _held that no stop string may end in
        self._stopped = False
        self.matched: str | None = None
        """The stop string that matched (``None`` until one did)."""

    @property
    def stopped(self) -> bool:
        """True once a stop string was found; later feeds emit nothing."""
        return self._stopped

    def feed(self, delta: str, match: bool = True) -> tuple[str, bool]:
        """Add a text delta; return ``(text safe to emit, stopped)``.

        On a match, ``text`` is what precedes the stop string (with ``include``: up to its
        end) and ``stopped`` is True; what follows is dropped. Otherwise
        the longest tail that is a proper prefix of some stop string (at most
        ``max(len(s)) - 1`` characters) is held back.

        With ``match=False`` the delta ends no stop string (vLLM's ``min_tokens``: the text of the
        first ``min_tokens`` tokens): it is emitted but for the held tail, where a stop string
        that ends in a later matching delta may begin.
        """
        if self._stopped:
            return "", True
        buf = self._held + delta
        cut = self._first_stop(buf, self._context) if match else None
        if cut is not None:
            self._held = ""
            self._stopped = True
            return buf[:cut], True
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        self._context = max(0, (len(buf) if not match else self._context) - (len(buf) - keep))
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Return the held tail when generation ends for another reason (length, EOS)."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _first_stop(self, buf: str, min_end: int) -> int | None:
        """Where ``buf`` is cut at the earliest-ending stop occurrence that ends after its first
        ``min_end`` characters (its start; with ``include`` its end), or None; the string is kept in
        :attr:`matched`."""
        best: tuple[int, int, str] | None = None
        for s in self._stops:
            start = buf.find(s, max(0, min_end - len(s) + 1))
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is None:
            return None
        self.matched = best[2]
        return best[0 if self._include else 1]

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:n]):
                    longest = n
                    break
        return longest
