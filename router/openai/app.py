"""The OpenAI-compatible HTTP front door (FastAPI): the router's request path behind OpenAI's API.

Routes: ``GET /v1/models`` (and ``/v1/models/{model}``), ``POST /v1/completions``, ``POST /v1/chat/completions``,
vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /version`` (:mod:`router.openai.tokenize`),
``GET /health`` (503 while no live prefill or decode worker), ``GET /metrics`` (the router's
Prometheus metrics) and ``GET /v1/prometheus/targets`` (Prometheus HTTP service discovery of
every process' ``/metrics``). With API keys, every route but ``/health`` needs one
(:mod:`router.openai.auth`).

A request becomes one :class:`router.active.ActiveRequest` per prompt x ``n``; each is relayed
on its own thread and its messages reach the event loop through a queue (:mod:`router.openai.pump`).
With vLLM's ``use_beam_search`` the ``n`` best beams are searched instead (:mod:`router.openai.beam`). Streams are SSE
(sse-starlette) ending with ``data: [DONE]``, started once the first message is in (a request
that fails before it gets its HTTP status, not a 200 with an error event); a client that
disconnects cancels every sub-request on both workers, before its first message or its
non-streamed answer too (the router checks every ``DISCONNECT_POLL_S`` seconds). Errors use OpenAI's body
``{"error": {message, type, param, code}}``; a body over ``max_request_bytes`` is refused with 413
before it is parsed (by its ``Content-Length``, :class:`router.openai.body.DeclaredSizeLimit`, else as it arrives),
and one that takes longer than ``body_timeout_s`` to arrive with 408 (:mod:`router.openai.body`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from router.core import RequestRouter
from router.errors import RouterError
from router.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES
from router.openai.auth import RequireApiKey
from router.openai.body import BodyDeadline, DeclaredSizeLimit
from router.openai.beam import check_beam_request, start_search, wants_beam_search
from router.openai.cors import with_cors
from router.openai.errors import (UNREADABLE_BODY, error_response, request_aliases, router_error_response,
                                  unknown_model, unreadable_body_response, validation_error_response)
from router.openai.http_metrics import CountRequests
from router.openai.protocol import ChatCompletionRequest, CompletionRequest
from router.openai.pump import pump, start_all
from router.openai.request_ids import RequestIds
from router.openai.chat import chat_requests
from router.openai.requests import (CHAT_ROUTE, COMPLETIONS_ROUTE, ID_PREFIXES, REQUEST_ID_HEADER, OpenAIRequestError,
                                    SubRequest, completion_requests)
from router.openai.responses import ResponseBuilder, StreamUsage, builder_for, totals
from router.openai.tokenize import add_tokenizer_routes
from serving.logs import request_scope
from serving.metrics import ProcessMetrics

DISCONNECT_POLL_S = 0.25
"""How often (seconds) a non-streamed request checks whether its client is still connected."""
GENERATION_ROUTES = tuple(ID_PREFIXES)
log = logging.getLogger(__name__)


@dataclass
class FrontDoorState:
    """What the routes read.

    Attributes:
        core: the request path.
        model_name: the served model's name (requests naming another get 404).
        tokenizer: for logprob token strings.
        health: ``() -> (serving, reason)``.
        targets: ``() -> `` the HTTP-SD document of every ``/metrics`` endpoint.
        metrics_registry: the router's Prometheus registry.
        accepts_api_key: ``f(bearer token or None) -> bool``: whether a request may pass
            (:meth:`serving.security.SecurityConfig.accepts_api_key`).
        created: Unix seconds the model was loaded (``/v1/models``).
        max_model_len: prompt + output limit in tokens (``/v1/models``, as vLLM reports it).
        max_request_bytes: the largest request body accepted (bytes; larger: 413).
        body_timeout_s: seconds a request's whole body may take to arrive (later: 408;
            :class:`router.openai.body.BodyDeadline`).
        metrics: the router's metrics, where a generation request the HTTP layer refuses
            itself counts in ``request_errors`` (``None``: not counted).
        allowed_origins: origins browsers may call from (CORS, :mod:`router.openai.cors`; none: off).
        eos_token_ids: the model's end-of-sequence tokens (a beam search ends a beam at one).
        reasoning_parser: the registered parser splitting chat answers' thinking off
            (:mod:`router.reasoning_parsers`; none: it stays in the content).
        tool_parser: the registered parser of ``tool_choice: "auto"`` answers (:mod:`router.tool_parsers`;
            none: ``auto`` is refused).
    """

    core: RequestRouter
    model_name: str
    tokenizer: object
    health: Callable[[], tuple[bool, str]]
    targets: Callable[[], list[dict]]
    metrics_registry: object
    accepts_api_key: Callable[[str | None], bool]
    created: int = 0
    max_model_len: int = 0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    metrics: ProcessMetrics | None = None
    allowed_origins: tuple[str, ...] = ()
    tool_parser: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    reasoning_parser: str | None = None


def build_app(state: FrontDoorState):
    """The ASGI application of the router's HTTP port, outermost first: with ``state.metrics``
    :class:`router.openai.http_metrics.CountRequests`, CORS (:mod:`router.openai.cors`, with
    ``state.allowed_origins``: preflights are answered before the key check),
    :class:`router.openai.request_ids.RequestIds` (refusals named and logged),
    :class:`router.openai.auth.RequireApiKey` (before any body is read), :class:`router.openai.body.DeclaredSizeLimit`,
    :class:`router.openai.body.BodyDeadline` (the body read in time and within its size), the FastAPI app."""
    app = FastAPI(title="pdcluster", docs_url=None, redoc_url=None)  # bodies: sized and timed by BodyDeadline
    _add_error_handlers(app, state)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    async def health():
        serving, reason = state.health()
        return Response(status_code=200) if serving else error_response(503, reason)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics_registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/prometheus/targets")
    async def targets():
        return JSONResponse(await run_in_threadpool(state.targets))

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "pdcluster",
                "root": state.model_name, "parent": None, "max_model_len": state.max_model_len}  # vLLM's card

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        return model_card() if model == state.model_name else unknown_model(model, state.model_name)

    chat_expander = partial(chat_requests, tool_parser=state.tool_parser, tokenizer=state.tokenizer,
                            reasoning_parser=state.reasoning_parser)

    @app.post(COMPLETIONS_ROUTE)
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(state, body, "completion", completion_requests, request)

    @app.post(CHAT_ROUTE)
    async def chat(body: ChatCompletionRequest, request: Request):
        return await _generate(state, body, "chat", chat_expander, request)
    add_tokenizer_routes(app, state)  # /tokenize, /detokenize, /version

    body_read = BodyDeadline(app, state.max_request_bytes, state.body_timeout_s)
    outer = with_cors(RequestIds(RequireApiKey(DeclaredSizeLimit(body_read, state.max_request_bytes),
                                               accepts=state.accepts_api_key)), state.allowed_origins)
    return CountRequests(outer, state.metrics, app.routes, GENERATION_ROUTES) if state.metrics is not None else outer


def _add_error_handlers(app: FastAPI, state: FrontDoorState) -> None:
    """OpenAI's error body for HTTP errors and for bodies FastAPI cannot validate (counted as refusals)."""

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        if exc.status_code == 400 and exc.detail == UNREADABLE_BODY:
            return _counted(state, request, unreadable_body_response(await request.body()))
        response = error_response(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError):
        return _counted(state, request,
                        validation_error_response(list(exc.errors()), request.headers.get("content-type")))


_REFUSAL_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT.name, 404: grpc.StatusCode.NOT_FOUND.name}
"""The ``request_errors`` code of a generation request the HTTP layer refuses before the request
path sees it (unreadable body, a field of the wrong type, an unknown model, an unsupported field),
so the counter holds every refusal, whichever layer made it."""


def _counted(state: FrontDoorState, request: Request, response: Response) -> Response:
    """``response``, a refusal, counted in ``request_errors`` when it answers a generation request."""
    code = _REFUSAL_CODES.get(response.status_code)
    if code is not None and state.metrics is not None and request.url.path in GENERATION_ROUTES:
        state.metrics.inc("request_errors", code=code)
    return response


async def _generate(state: FrontDoorState, body, kind: str, expand, request: Request):
    if body.model and body.model != state.model_name:  # left out or "": the served model, as vLLM
        return _counted(state, request, unknown_model(body.model, state.model_name))
    try:
        base, subs = expand(body, request.headers.get(REQUEST_ID_HEADER))
        beam = wants_beam_search(body)
    except OpenAIRequestError as e:  # before the request has an id: router.openai.request_ids names it
        return _counted(state, request, error_response(e.status, e.message, param=e.param, code=e.code))
    if beam:
        response = await _beam_answer(state, body, kind, base, subs, request)
    else:
        response = await _answer(state, body, kind, base, subs, request)
    response.headers[REQUEST_ID_HEADER] = base  # the log lines' request ids are it plus "-<choice>"
    return response


async def _answer(state: FrontDoorState, body, kind: str, base: str, subs: list[SubRequest], request: Request):
    try:
        actives = await run_in_threadpool(start_all, state.core, subs, body.n)
    except OpenAIRequestError as e:
        with request_scope(base):
            log.info("request refused: HTTP %d: %s", e.status, e.message)
        return _counted(state, request, error_response(e.status, e.message, param=e.param, code=e.code))
    except RouterError as e:
        return router_error_response(e, aliases=request_aliases(body))
    if state.metrics is not None:
        state.metrics.observe("request_params_n", body.n)
    aliases = request_aliases(body)
    with request_scope(base):
        log.info("%s request: %d sub-request(s), stream=%s, user=%r", kind, len(subs), body.stream, body.user)
    builder = builder_for(kind, base, state.model_name, state.tokenizer, body, subs)
    events = pump(subs, actives)
    if body.stream:
        opts = body.stream_options
        final = bool(opts and opts.include_usage)
        usage = StreamUsage(final, [len(a.prep.prompt_token_ids) for a in actives]
                            if final and opts.continuous_usage_stats else None)
        response = await _stream(events, builder, request, subs, body.n, usage, aliases)
    else:
        response = await _whole(events, builder, request, subs[0].top_logprobs, body.n, aliases)
    return response


async def _beam_answer(state: FrontDoorState, body, kind: str, base: str, subs: list[SubRequest], request: Request):
    """vLLM's ``use_beam_search`` (:mod:`router.openai.beam`): the whole answer once every search ended; a
    client that disconnects stops the search at its next step."""
    cancelled = threading.Event()
    try:
        penalty = check_beam_request(body, subs)
        with request_scope(base):
            log.info("%s request: beam search of width %d, %d prompt(s)", kind, body.n, len(subs) // body.n)
        choices = await _unless_gone(start_search(state.core, subs, body.n, penalty, state.eos_token_ids, cancelled),
                                     request, base)
    except OpenAIRequestError as e:
        return _counted(state, request, error_response(e.status, e.message, param=e.param, code=e.code))
    except RouterError as e:
        return router_error_response(e, aliases=request_aliases(body))
    finally:
        cancelled.set()
    if choices is _GONE:
        return _client_closed()
    return JSONResponse(builder_for(kind, base, state.model_name, state.tokenizer, body, subs).whole(choices, 0, body.n))


_GONE = object()


def _client_closed():
    return error_response(499, "the client closed the request")


async def _unless_gone(awaitable, request: Request, request_id: str):
    """``await awaitable``, unless the client disconnects first (checked every
    :data:`DISCONNECT_POLL_S` seconds): then it is cancelled (in ``_pump`` that cancels every
    sub-request on both workers) and :data:`_GONE` is returned."""
    task = asyncio.ensure_future(awaitable)
    try:
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                with request_scope(request_id):
                    log.info("client disconnected before the answer: cancelling the request")
                return _GONE
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _whole(events, builder: ResponseBuilder, request: Request, top_logprobs: int, n: int,
                 aliases: dict[str, str]):
    """The non-streamed answer once every sub-request finished. A client that disconnects
    first cancels them all on both workers, as a stream's does, instead of leaving them to run
    to ``max_tokens`` for nobody."""

    async def collect():
        choices: dict[int, list] = {}
        async for index, item in events:
            if isinstance(item, RouterError):
                return router_error_response(item, aliases=aliases)
            choices.setdefault(index, []).append(item)
        return JSONResponse(builder.whole(choices, top_logprobs, n))

    try:
        answer = await _unless_gone(collect(), request, builder.id)
        return _client_closed() if answer is _GONE else answer
    finally:
        await events.aclose()


async def _stream(events, builder: ResponseBuilder, request: Request, subs: list[SubRequest], n: int,
                  usage: StreamUsage, aliases: dict[str, str]):
    """The SSE answer, started once the first message is in: a request that fails before it (no
    live worker, refused on placement) gets its HTTP status (503, 429, ...) rather than a 200
    whose stream carries the error; a later failure ends the stream with an error event."""
    first = await _unless_gone(anext(events, None), request, builder.id)
    if first is _GONE or (first is not None and isinstance(first[1], RouterError)):
        await events.aclose()
        if first is _GONE:
            return _client_closed()
        return router_error_response(first[1], aliases=aliases)

    async def chained():
        try:
            if first is not None:
                yield first
            async for item in events:
                yield item
        finally:
            await events.aclose()

    # sep: each event ends with "\n\n", as vLLM's (sse-starlette writes "\r\n\r\n" by default)
    return EventSourceResponse(_sse(chained(), builder, subs, n, usage), ping=15, sep="\n")


async def _sse(events, builder: ResponseBuilder, subs: list[SubRequest], n: int, usage: StreamUsage):
    offsets: dict[int, int] = {}
    usages = {}
    try:
        async for index, item in events:
            if isinstance(item, RouterError):
                yield {"data": json.dumps(router_error_response(item, body_only=True))}
                break
            first = index not in offsets
            if first and builder.kind == "chat":
                role = builder.role_chunk(index)
                if usage.prompts is not None:
                    role["usage"] = usage.add(index, 0)
                yield {"data": json.dumps(role)}
            so_far = usage.add(index, len(item.token_ids))
            if not ((first and builder.kind != "chat") or item.text or item.finish_reason or len(item.logprobs)):
                offsets.setdefault(index, 0)
                continue  # tokens whose text is held back (a stop string may begin there): nothing to send
            chunk = builder.chunk(index, item, subs[0].top_logprobs, offsets.get(index, 0))
            if chunk is None:  # text a tool parser holds back
                offsets.setdefault(index, 0)
                continue
            if so_far is not None:
                chunk["usage"] = so_far
            offsets[index] = offsets.get(index, 0) + len(item.text)
            if item.HasField("usage") and item.finish_reason:
                usages[index] = item.usage
            yield {"data": json.dumps(chunk)}
        if usage.final:
            yield {"data": json.dumps(builder.usage_chunk(*totals(usages, n)))}
        yield {"data": "[DONE]"}
    finally:
        await events.aclose()
