"""HTTP requests by route and status on the router's HTTP port: the outermost ASGI layer, so every
answer counts, also those the inner layers give before any route runs (413 over the size limit,
401 without an API key, 408 for a slow body); the connection guards' answers below ASGI (400, 408
for a late head, 503) are counted by :mod:`router.http_protocol`'s ``answered`` hook.

``pdcluster:http_requests_total{method, handler, status}`` (vLLM exposes the same figure through
prometheus-fastapi-instrumentator as ``http_requests_total``): ``handler`` is the route's template
(``/v1/models/{model}``), or ``other`` for a path no route serves, and ``method`` one of HTTP's
methods or ``other``, so a scan of random paths or methods cannot grow the series without bound; ``status`` is the answer's HTTP status (a stream counts 200 when it
starts). A request whose client left before any answer counts ``499``, as nginx logs it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from starlette.routing import BaseRoute, Match

from serving.metrics import ProcessMetrics

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""The ``method`` label's values besides ``other``: HTTP's parser takes any token as a method, and a
label per token would let a client without a key grow the series without bound."""
CLIENT_CLOSED = 499
BODY_REFUSALS = {413: "RESOURCE_EXHAUSTED", 408: "DEADLINE_EXCEEDED"}
"""A generation request refused for its body (too large, too slow: :mod:`router.openai.body`) before any
route saw it counts in ``request_errors`` with this code, so every generation request counts once in
``request_success`` or ``request_errors`` (gRPC's own status for the same refusals)."""
_CONVERTER = re.compile(r"{(\w+):\w+}")


def method_of(scope) -> str:
    """The ``method`` label of an HTTP scope: its method when :data:`METHODS` has it, else ``other``."""
    method = scope.get("method", "")
    return method if method in METHODS else "other"


def handler_of(routes: Sequence[BaseRoute], scope) -> str:
    """The template of the route an HTTP scope reaches (``/v1/models/{model}``, converters left out),
    a route of its path whatever the method (a 405), else ``other``: the app's own routes, matched as
    its router matches them, so a route is declared once, in the app."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return _CONVERTER.sub(r"{\1}", route.path)
        if match is Match.PARTIAL and partial is None:
            partial = route
    return _CONVERTER.sub(r"{\1}", partial.path) if partial is not None else "other"


class CountRequests:
    """ASGI middleware counting each HTTP request once, with the status of its answer.

    Args:
        app: the wrapped ASGI application.
        metrics: the router's metrics (``http_requests``; ``request_errors`` for :data:`BODY_REFUSALS`).
        routes: the routes of the application's router (``FastAPI.routes``), for the ``handler`` label.
        generation_routes: the routes whose body refusals count in ``request_errors``.
    """

    def __init__(self, app, metrics: ProcessMetrics, routes: Sequence[BaseRoute],
                 generation_routes: Sequence[str] = ()) -> None:
        self.app = app
        self._m = metrics
        self._routes = routes
        self._generation = frozenset(generation_routes)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = CLIENT_CLOSED

        async def send_counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            handler = handler_of(self._routes, scope)
            self._m.inc("http_requests", method=method_of(scope), handler=handler, status=str(status))
            if status in BODY_REFUSALS and handler in self._generation:
                self._m.inc("request_errors", code=BODY_REFUSALS[status])
