"""Every answer of a generation route names its request, refusals too: the ``X-Request-Id`` header.

The route sets it once the request has its id (``cmpl-<id>`` / ``chatcmpl-<id>``, the base of the
router's log lines about it). An answer given before that (an unknown model, a body of the wrong
shape, one too large or too slow, a missing API key) gets one here, the id the route would have given:
the prefix plus the client's own ``X-Request-Id`` when it sent a valid one, else plus a random one;
and the refusal is logged with that id, its HTTP status and its error message (at most one line a
second under a storm: :class:`serving.logs.ThrottledLog`). vLLM names requests from the same header.
"""

from __future__ import annotations

import json
import logging

from router.openai.requests import ID_PREFIXES, REQUEST_ID_HEADER, OpenAIRequestError, base_id
from serving.logs import ThrottledLog

log = logging.getLogger(__name__)
_refused = ThrottledLog(log, "HTTP requests refused before they had an id")
HEADER = REQUEST_ID_HEADER.lower().encode()
"""The header's name as ASGI carries it."""
_MAX_LOGGED_BODY = 4096


def request_id_for(prefix: str, client_id: bytes | None) -> str:
    """The id the route gives (:func:`router.openai.requests.base_id`) from the client's id, or a random
    one where the route would refuse the client's id."""
    try:
        return base_id(prefix, None if client_id is None else client_id.decode("latin-1"))
    except OpenAIRequestError:
        return base_id(prefix, None)


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


class RequestIds:
    """ASGI middleware: names and logs the generation routes' answers given before the request had an id.

    Args:
        app: the wrapped ASGI application.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        prefix = ID_PREFIXES.get(scope.get("path", "")) if scope["type"] == "http" else None
        if prefix is None:
            await self.app(scope, receive, send)
            return
        named: str | None = None
        status, body = 0, b""

        async def send_named(message) -> None:
            nonlocal named, status, body
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(k.lower() == HEADER for k, _ in headers):
                    client = next((v for k, v in scope.get("headers", ()) if k == HEADER), None)  # the first
                    named = request_id_for(prefix, client)
                    message = {**message, "headers": [*headers, (HEADER, named.encode())]}
                status = message["status"]
            elif message["type"] == "http.response.body" and named is not None and len(body) < _MAX_LOGGED_BODY:
                body += message.get("body", b"")[:_MAX_LOGGED_BODY]
            await send(message)
            if named is not None and status >= 400 and message["type"] == "http.response.body" \
                    and not message.get("more_body"):
                _refused.info(named, "request %s refused: HTTP %d: %s", named, status, _message(body))

        await self.app(scope, receive, send_named)
