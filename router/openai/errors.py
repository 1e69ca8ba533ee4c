"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

gRPC status -> HTTP status: INVALID_ARGUMENT / OUT_OF_RANGE / ALREADY_EXISTS 400,
UNAUTHENTICATED 401, NOT_FOUND 404, RESOURCE_EXHAUSTED 429, CANCELLED 499 (client closed),
UNAVAILABLE 503, DEADLINE_EXCEEDED 504, anything else 500; a refusal with a retry-after hint
(429) also carries ``Retry-After`` (whole seconds, at least 1) and ``retry-after-ms`` headers,
both of which the ``openai`` client honours. ``param`` is the request field
a router message names (``sampling.top_p ...`` -> ``top_p``; ``prompt: ...`` -> ``prompt``;
``messages[1].role ...`` -> ``messages``).
"""

from __future__ import annotations

import json
import math
import re

import grpc
from fastapi.responses import Response

from router.core import RouterError

_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 429: "rate_limit_error", 499: "invalid_request_error"}
_PARAM = re.compile(r"^(?:sampling\.)?([a-z_]+)(?:\[[^\]]*\])?[ :.]")


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status of a gRPC status code (500 when unmapped)."""
    return _HTTP.get(code, 500)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code if code is not None else status}}


def json_response(body: dict, status: int) -> Response:
    """``body`` as JSON with non-ASCII escaped, so a string echoed from a request that
    UTF-8 cannot encode (a lone surrogate from a JSON escape) still renders."""
    return Response(json.dumps(body), status_code=status, media_type="application/json")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> Response:
    """A JSON error response in OpenAI's shape."""
    return json_response(error_body(status, message, param, code), status)


def router_error_response(e: RouterError, body_only: bool = False):
    """The response (or with ``body_only`` the body) of a :class:`RouterError`."""
    status = http_status(e.code)
    match = _PARAM.match(e.message) if status == 400 else None
    body = error_body(status, e.message, param=match.group(1) if match else None, code=e.code.name.lower())
    if body_only:
        return body
    response = json_response(body, status)
    if e.retry_after_ms is not None:
        response.headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_ms / 1000)))
        response.headers["retry-after-ms"] = str(e.retry_after_ms)
    return response
