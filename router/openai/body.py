"""Request bodies must arrive in time and within their size: the HTTP port's defence against slow
and endless senders.

uvicorn times out idle keep-alive connections but not a request whose body trickles in (or never
comes after its headers): each such request would hold a connection and a task for as long as the
client keeps its socket open. :class:`BodyDeadline` reads the whole body before the application
sees the request, within ``timeout_s`` seconds of the request's start, and answers 408 in OpenAI's
error shape when it does not arrive (vLLM and SGLang leave this to a proxy in front of them; the
router is the front door here). A body without a ``Content-Length`` that grows past
``max_bytes`` is refused with 413 as it arrives (one with a larger length never gets here:
:class:`DeclaredSizeLimit`).

Before a 413 the rest of the refused body is read and dropped (:func:`drain`, bounded in bytes and
time), as a server's lingering close does (nginx's ``lingering_close``): a client that sends its
whole body before reading the answer (Python's urllib, ``requests``) otherwise gets a connection
reset instead of the 413. A client that sent ``Expect: 100-continue`` (curl, for large bodies) gets
the 413 before it sends its body.
"""

from __future__ import annotations

import asyncio
import logging
import time

from router.limits import DEFAULT_BODY_TIMEOUT_S
from router.openai.errors import error_response

log = logging.getLogger(__name__)


DRAIN_BYTES = 64 << 20  # the most of a refused body read and dropped before its 413
DRAIN_S = 2.0  # seconds


async def drain(receive, max_bytes: int = DRAIN_BYTES, timeout_s: float = DRAIN_S) -> None:
    """Read and drop the request's remaining body: until its last part, a disconnect, ``max_bytes`` bytes
    or ``timeout_s`` seconds, whichever comes first (then the 413 goes out and the connection closes; past
    those bounds the client may see a reset). Call it before the response starts: uvicorn gives no more
    body once a response is complete."""
    deadline, got = time.monotonic() + timeout_s, 0
    while got <= max_bytes:
        try:
            msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return
        got += len(msg.get("body", b""))
        if msg["type"] != "http.request" or not msg.get("more_body", False):
            return


def too_large(limit: int):
    """The 413 response (OpenAI's error shape) to a body over ``limit`` bytes."""
    return error_response(413, f"the request body is larger than max_request_bytes ({limit} bytes)",
                          code="request_too_large")


class BodyDeadline:
    """ASGI layer: reads an HTTP request's body (all its ``http.request`` messages) before calling
    ``app``, which then receives it as one message, and the connection's later messages (the
    client's disconnect) as they come.

    Args:
        app: the ASGI application behind it.
        max_bytes: the largest body accepted (bytes); a larger one gets 413 once that many came.
        timeout_s: seconds from the request's start for the whole body (> 0).

    Raises:
        ValueError: ``max_bytes`` or ``timeout_s`` not positive.
    """

    def __init__(self, app, max_bytes: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        if not timeout_s > 0 or max_bytes <= 0:
            raise ValueError(f"max_bytes ({max_bytes}) and the HTTP body timeout ({timeout_s} s) must be positive")
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self.timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                log.info("%s %s: the request body did not arrive within %.1f s (%d bytes came): 408",
                         scope.get("method"), scope.get("path"), self.timeout_s, size)
                await error_response(408, f"the request body did not arrive within http_body_timeout_s "
                                          f"({self.timeout_s:g} s; {size} bytes came)",
                                     code="request_timeout")(scope, receive, send)
                return
            if msg["type"] == "http.disconnect":
                return  # the client left before its body was complete: nothing to answer
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                if msg.get("more_body", False):
                    await drain(receive)
                await too_large(self.max_bytes)(scope, receive, send)
                return
            if not msg.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)


def _replay(body: bytes, receive):
    """A ``receive`` that gives ``body`` as the request's one ``http.request`` message, then
    whatever ``receive`` gives (the disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


class DeclaredSizeLimit:
    """ASGI layer: a request whose ``Content-Length`` exceeds ``limit`` bytes gets the
    413 in OpenAI's error shape, its body dropped unparsed (:func:`drain`; FastAPI's own limit, which still counts
    the bytes of a body sent without a length, answers this case in plain text). A request with
    both ``Content-Length`` and ``Transfer-Encoding`` gets a 400 (RFC 9112 6.1 lets a server refuse
    it; a proxy in front that reads the other header would see another request boundary: request
    smuggling)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers", ()))
            length = headers.get(b"content-length", b"")
            if length and b"transfer-encoding" in headers:
                await error_response(400, "a request may not carry both Content-Length and Transfer-Encoding",
                                     code="invalid_request")(scope, receive, send)
                return
            if length.isdigit() and int(length) > self.limit:
                if headers.get(b"expect", b"").lower() != b"100-continue":  # else its body is not sent yet
                    await drain(receive)
                await too_large(self.limit)(scope, receive, send)
                return
        await self.app(scope, receive, send)
