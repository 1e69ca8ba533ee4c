"""Completions' ``echo`` (:func:`router.openai.requests.completion_requests` checks it): what the
response builder (:mod:`router.openai.responses`) puts before each choice's text and logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.openai.requests import SubRequest


@dataclass(frozen=True)
class Echo:
    """``/v1/completions`` ``echo``: each choice's text, and its logprobs, start with its prompt's.

    Attributes:
        prompts: choice index -> its prompt's text (a token-id prompt decoded).
        only: ``max_tokens`` 0: the prompt alone, nothing generated shown.
    """

    prompts: dict[int, str]
    only: bool = False


def echo_of(body, subs: list[SubRequest], tokenizer) -> Echo | None:
    """The :class:`Echo` of a completions ``body`` (None without ``echo``)."""
    if not getattr(body, "echo", False):
        return None
    texts = {s.index: s.request.text if s.request.WhichOneof("prompt") == "text"
             else tokenizer.decode(list(s.request.token_ids.ids)) for s in subs}
    return Echo(texts, only=body.max_tokens == 0)
