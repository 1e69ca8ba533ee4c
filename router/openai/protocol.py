"""Request bodies of the OpenAI-compatible API (pydantic models), as OpenAI and vLLM accept them.

OpenAI's own fields are declared; other fields are kept aside (``extra="allow"``) and only
those named like a declared sampling parameter (:mod:`common.sampling_params`) are read, so
unknown fields are ignored, as OpenAI's servers do. Ranges are checked by the router's validator (the same checks as the
gRPC API, :mod:`router.validation`), so both front doors refuse the same requests with the
same messages; the models only check shapes (types, one of ``prompt`` forms, content parts).

Sources: OpenAI API reference (``/v1/completions``, ``/v1/chat/completions``), vLLM's
``vllm/entrypoints/openai/protocol.py`` for the extra sampling fields (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``).
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Extensible(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Extensible):
    """Fields both endpoints share (OpenAI names; vLLM's extras)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a token-id list
    or a list of token-id lists; ``logprobs`` is the number of top logprobs per token."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    """One chat message: ``content`` is a string or a list of content parts (only ``text``
    parts are served; other part types are refused by the router with their names)."""

    model_config = ConfigDict(extra="ignore")
    role: str
    content: Union[str, list[dict], None] = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: ``logprobs`` (bool) + ``top_logprobs`` (0..20);
    ``max_completion_tokens`` is the newer name of ``max_tokens``."""

    messages: list[ChatMessageIn] = Field(default_factory=list)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
