"""API keys on the router's HTTP port: an ASGI middleware in front of the whole FastAPI app.

Every request except ``/health`` needs ``Authorization: Bearer KEY`` naming one of the
router's API keys (:meth:`serving.security.SecurityConfig.accepts_api_key`; no keys: every
request passes). ``/metrics`` and ``/v1/prometheus/targets`` are protected too: Prometheus
sends a key from its ``authorization`` settings (``deploy/prometheus/prometheus.yml``).
A request without a valid key gets 401 with OpenAI's error body (type
``authentication_error``, code ``invalid_api_key``) before the app reads its body or any
route runs.
"""

from __future__ import annotations

from collections.abc import Callable

from common.grpc_metadata import AUTHORIZATION, bearer_token
from router.openai.errors import error_response

EXEMPT_PATHS = frozenset({"/health"})
_HEADER = AUTHORIZATION.encode()


class RequireApiKey:
    """ASGI middleware refusing HTTP requests whose bearer token ``accepts`` rejects.

    Args:
        app: the wrapped ASGI application.
        accepts: ``f(token or None) -> bool``.
    """

    def __init__(self, app, accepts: Callable[[str | None], bool]) -> None:
        self.app = app
        self._accepts = accepts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in EXEMPT_PATHS or self._accepts(_token(scope)):
            await self.app(scope, receive, send)
            return
        response = error_response(401, "missing or invalid API key: send 'Authorization: Bearer KEY'",
                                  code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def _token(scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == _HEADER:
            return bearer_token(value.decode("latin-1"))
    return None
