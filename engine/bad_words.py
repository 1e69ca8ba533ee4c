"""vLLM's ``bad_words``: words a request's output never contains.

A word arrives as token-id sequences (the router tokenizes it as written and, where that makes
other tokens, with a leading space: :func:`router.validation` via ``WorkerRequest.bad_words_token_ids``).
Before each sampled token, a sequence's last token is banned when the request's output so far ends
with the sequence's other tokens (a one-token word is banned everywhere). Only the output is matched,
not the prompt, as vLLM v1's ``apply_bad_words``; the ban is then one more ``-inf`` id per word
(:func:`engine.logits_processors.ban_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence


def banned_next(bad_words: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> tuple[int, ...]:
    """The ids a request may not sample next, given its ``output_token_ids`` so far (sorted, unique)."""
    banned = set()
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > len(output_token_ids):
            continue
        if prefix == 0 or list(output_token_ids[-prefix:]) == list(word[:prefix]):
            banned.add(word[-1])
    return tuple(sorted(banned))
