"""HTTP requests by route and status on the router's HTTP port: the outermost ASGI layer, so every
answer counts, also those the inner layers give before any route runs (413 over the size limit,
401 without an API key, 408 for a slow body).

``pdcluster:http_requests_total{method, handler, status}`` (vLLM exposes the same figure through
prometheus-fastapi-instrumentator as ``http_requests_total``): ``handler`` is the route's template
(``/v1/models/{model}``), or ``other`` for a path no route serves, so a scan of random paths cannot
grow the series without bound; ``status`` is the answer's HTTP status (a stream counts 200 when it
starts). A request whose client left before any answer counts ``499``, as nginx logs it.
"""

from __future__ import annotations

from serving.metrics import ProcessMetrics

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
ROUTES = (*GENERATION_ROUTES, "/v1/models", "/health", "/metrics", "/v1/prometheus/targets")
MODEL_ROUTE = "/v1/models/{model}"
CLIENT_CLOSED = 499


def handler_of(path: str) -> str:
    """The route template ``path`` reaches, or ``other``."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/") and len(path) > len("/v1/models/"):
        return MODEL_ROUTE
    return "other"


class CountRequests:
    """ASGI middleware counting each HTTP request once, with the status of its answer.

    Args:
        app: the wrapped ASGI application.
        metrics: the router's metrics (``http_requests``).
    """

    def __init__(self, app, metrics: ProcessMetrics) -> None:
        self.app = app
        self._m = metrics

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
            self._m.inc("http_requests", method=scope.get("method", ""), handler=handler_of(scope["path"]),
                        status=str(status))
