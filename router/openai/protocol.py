"""Request bodies of the OpenAI-compatible API (pydantic models), as OpenAI and vLLM accept them.

OpenAI's own fields are declared; other fields are kept aside (``extra="allow"``) and only
those named like a declared sampling parameter (:mod:`common.sampling_params`) are read, so
unknown fields are ignored, as OpenAI's servers do (OpenAI fields this server does not serve
are refused when asked for: :func:`router.openai.requests.refuse_unsupported`). Ranges are
checked by the router's validator (the same checks as the gRPC API, :mod:`router.validation`),
so both front doors refuse the same requests with the same messages; the models only check
shapes (types, one of ``prompt`` forms, content parts).
Types are strict, as in OpenAI's JSON schema: ``true`` is not an integer or a number (pydantic's
lax mode would read it as 1), ``"0.5"`` is not a number; an integer is a number. An explicit
``null`` is the field left out (OpenAI's schema allows ``null`` for its optional fields, and SDKs
send it for arguments left unset): ``"n": null`` is ``n`` 1, ``"stream": null`` is no stream.

Sources: OpenAI API reference (``/v1/completions``, ``/v1/chat/completions``), vLLM's
``vllm/entrypoints/openai/protocol.py`` for the extra sampling fields (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``).
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, model_validator


def _null_is_absent(model: type[BaseModel], data):
    """``data`` without the ``null`` values of ``model``'s optional fields (their defaults then
    apply); a required field's ``null`` stays, to be refused naming it."""
    if not isinstance(data, dict):
        return data
    fields = model.model_fields
    return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data):
        return _null_is_absent(cls, data)


class _Extensible(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data):
        return _null_is_absent(cls, data)


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: every chunk carries its usage so far


class _Sampling(_Extensible):
    """Fields both endpoints share (OpenAI names; vLLM's extras)."""

    model: str | None = None  # vLLM's: left out, the served model (OpenAI requires it)
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[StrictInt] | None = None
    n: StrictInt = 1
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_tokens_as_token_ids: StrictBool = False  # vLLM's: logprobs name tokens "token_id:<id>"


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a token-id list
    or a list of token-id lists; ``logprobs`` is the number of top logprobs per token."""

    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    """One chat message: ``content`` is a string or a list of content parts (only ``text``
    parts are served; other part types are refused by the router with their names)."""

    model_config = ConfigDict(extra="ignore")
    role: str
    content: Union[str, list[dict], None] = None
    tool_calls: list[dict] | None = None  # an assistant message's calls (router.openai.chat)
    tool_call_id: str | None = None  # a tool message's answered call
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: ``logprobs`` (bool) + ``top_logprobs`` (0..20);
    ``max_completion_tokens`` is the newer name of ``max_tokens``."""

    messages: list[ChatMessageIn]  # required, as OpenAI's: a missing one reads "messages: Field required"
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool | None = None  # vLLM's chat options (router.chat.ChatOptions)
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict] | None = None  # router.tool_choice
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: StrictBool | None = None
    include_reasoning: StrictBool = True  # vLLM's: false leaves reasoning_content out (router.answer)
