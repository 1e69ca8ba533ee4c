"""Running an HTTP request's sub-requests: register them all or none (:func:`start_all`), then
relay their messages to the event loop (:func:`pump`). With ``n`` > 1 the first sample runs alone
until its first token (its prefill is done and its full blocks are in the prefill worker's prefix
cache), then the others start and reuse them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc

from router.active import ActiveRequest
from router.core import RequestRouter
from router.errors import RouterError
from router.openai.requests import OpenAIRequestError, SubRequest

FIRST_SAMPLE_WAIT_S = 600.0
"""Seconds the other samples of a prompt wait for its first sample's first token."""


def check_capacity(core: RequestRouter, count: int, what: str, param: str) -> None:
    """Refuse ``count`` requests at once (``what`` names them) where the router holds fewer at once:
    no retry could admit them.

    Raises:
        OpenAIRequestError: 400 naming ``param``.
    """
    capacity = core.admission.capacity() if core.admission is not None else None
    if capacity is not None and count > capacity:
        raise OpenAIRequestError(
            f"{what} exceed the {capacity} requests this router holds at once "
            "(the decode workers' max_num_seqs + max_queued_requests, shared by the routers)", param=param)


def start_all(core: RequestRouter, subs: list[SubRequest], n: int) -> list[ActiveRequest]:
    """Validate and register every sub-request (all or none).

    Raises:
        OpenAIRequestError: 400: more sub-requests (prompts x ``n``) than the router holds at once
            now (its admission capacity): no retry could admit them.
        RouterError: the first one refused (the others are discarded).
    """
    check_capacity(core, len(subs), f"{len(subs)} choices (prompts x n)", "n" if n > 1 else "prompt")
    actives: list[ActiveRequest] = []
    try:
        for sub in subs:
            actives.append(core.start(sub.request))
    except RouterError:
        for a in actives:
            a.discard()
        raise
    return actives


async def pump(subs: list[SubRequest], actives: list[ActiveRequest]) -> AsyncIterator[tuple[int, object]]:
    """Yield ``(choice index, GenerateResponse | RouterError)`` as the sub-requests produce them;
    cancels every sub-request if the consumer stops early (client gone, first error)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    first_token = threading.Event()

    def relay(i: int, active: ActiveRequest) -> None:
        try:
            if i > 0 and not first_token.wait(FIRST_SAMPLE_WAIT_S):
                late = RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "the first sample did not start in time")
                active.discard(late)  # its responses() never runs: forgotten and counted here
                raise late
            for msg in active.responses():
                loop.call_soon_threadsafe(queue.put_nowait, (subs[i].index, msg))
                if msg.token_ids:
                    first_token.set()
        except RouterError as e:
            loop.call_soon_threadsafe(queue.put_nowait, (subs[i].index, e))
        finally:
            first_token.set()
            loop.call_soon_threadsafe(queue.put_nowait, (subs[i].index, None))

    for i, active in enumerate(actives):
        threading.Thread(target=relay, args=(i, active), name=f"http-{active.request_id}", daemon=True).start()
    pending = len(actives)
    try:
        while pending:
            index, item = await queue.get()
            if item is None:
                pending -= 1
                continue
            yield index, item
    finally:
        if pending:
            for a in actives:
                a.cancel()
            first_token.set()
