"""vLLM's tokenizer routes of the OpenAI-compatible server: ``POST /tokenize``, ``POST /detokenize``
and ``GET /version`` (shapes from vLLM's ``TokenizeRequest`` / ``DetokenizeRequest`` and their
responses in ``vllm/entrypoints/openai/protocol.py``).

``/tokenize`` takes a ``prompt`` (tokenized as ``/v1/completions`` tokenizes it: with the tokenizer's
special tokens unless ``add_special_tokens`` is false) or chat ``messages`` (rendered and tokenized
as ``/v1/chat/completions`` renders them, with the same chat options: ``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``), and answers
``{count, max_model_len, tokens, token_strs}`` (``token_strs``: the vocabulary entries, with
``return_token_strs``). A prompt longer than ``max_model_len`` is counted, not refused (a client
uses the count to decide). ``/detokenize`` answers ``{prompt}``: the text of ``tokens`` (every id
in the vocabulary, at most ``max_model_len`` of them), special tokens included, as vLLM decodes it.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any, Union

from fastapi import FastAPI
from pydantic import StrictBool, StrictInt
from starlette.concurrency import run_in_threadpool

from pdcluster.v1 import router_pb2
from router.openai.chat import chat_prompt
from router.openai.errors import error_response, named_param, unknown_model
from router.openai.protocol import ChatMessageIn, _Body
from router.openai.requests import OpenAIRequestError, check_utf8, refuse_unsupported
from router.tool_choice import ToolRequestError, template_tools
from router.validation import InvalidRequest


class TokenizeRequest(_Body):
    """``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool = False
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    chat_template: Union[str, None] = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict] | None = None  # given to the chat template


class DetokenizeRequest(_Body):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[StrictInt]


def _server_version() -> str:
    try:
        return version("pdcluster")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


def add_tokenizer_routes(app: FastAPI, state) -> None:
    """Add ``/tokenize``, ``/detokenize`` and ``/version`` to ``app``; ``state`` is the
    :class:`router.openai.app.FrontDoorState`."""

    @app.get("/version")
    async def server_version():
        return {"version": _server_version()}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model and body.model != state.model_name:
            return unknown_model(body.model, state.model_name)
        try:
            ids = await run_in_threadpool(_tokenize, state, body)
        except OpenAIRequestError as e:
            return error_response(e.status, e.message, param=e.param, code=e.code)
        except InvalidRequest as e:
            return error_response(400, str(e), param=named_param(str(e)) or ("messages" if body.messages else "prompt"))
        strs = state.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model and body.model != state.model_name:
            return unknown_model(body.model, state.model_name)
        if len(body.tokens) > state.max_model_len:  # no sequence of this model is longer
            return error_response(400, f"tokens has {len(body.tokens)} ids; at most max_model_len "
                                       f"({state.max_model_len})", param="tokens")
        vocab = state.core.validator.limits.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            return error_response(400, f"tokens[{bad}]: id {body.tokens[bad]} is not in [0, {vocab}) (the vocabulary)",
                                  param="tokens")
        return {"prompt": await run_in_threadpool(state.tokenizer.decode, body.tokens)}


def _tokenize(state, body: TokenizeRequest) -> list[int]:
    """The token ids ``/v1/completions`` or ``/v1/chat/completions`` would compute for ``body``.

    Raises:
        OpenAIRequestError: neither or both of ``prompt`` and ``messages``; a field this server does
            not serve (``add_special_tokens`` with messages, a chat template of the request's own ...).
        InvalidRequest: the router's prompt checks (empty, over ``max_prompt_bytes``, bad messages).
    """
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIRequestError("exactly one of prompt and messages is required", param="prompt")
    refuse_unsupported(body, served=frozenset({"tools"}))
    if body.tools and body.messages is None:
        raise OpenAIRequestError("tools go to the chat template: give them with messages", param="tools")
    if body.messages is not None:
        if body.add_special_tokens:
            raise OpenAIRequestError("add_special_tokens: true is not supported with messages (the chat "
                                     "template places the special tokens)", param="add_special_tokens",
                                     code="unsupported_parameter")
        try:
            tools = template_tools(body.tools)
        except ToolRequestError as e:
            raise OpenAIRequestError(str(e), param=e.param) from None
        req = router_pb2.GenerateRequest(messages=chat_prompt(body, tools))
        return state.core.validator.tokenize(req)
    check_utf8(body.prompt, "prompt", "prompt")
    return state.core.validator.tokenize(router_pb2.GenerateRequest(text=body.prompt),
                                         add_special_tokens=body.add_special_tokens is not False)
